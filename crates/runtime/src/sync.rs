//! Locks that recover from poisoning. Every critical section in the
//! operator and the EPP is a short update of plain fields (counters,
//! estimates, caches, queues), so a panic elsewhere cannot leave one
//! half-written in a way later readers would trip on: serving possibly
//! stale state beats failing every request after it.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// `m`'s guard, poisoned or not.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `l`'s read guard, poisoned or not.
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// `l`'s write guard, poisoned or not.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panic_still_serves_its_value() {
        let m = Mutex::new(1);
        let l = RwLock::new(2);
        let _ = std::panic::catch_unwind(|| {
            let _m = m.lock().unwrap();
            let _l = l.write().unwrap();
            panic!("poisons both");
        });
        assert!(m.is_poisoned() && l.is_poisoned());
        *lock(&m) += 1;
        *write(&l) += 1;
        assert_eq!((*lock(&m), *read(&l)), (2, 3));
    }
}
