//! Lock helper shared by the estimators. A poisoned lock is recovered: the
//! critical sections are plain field updates, so serving possibly stale
//! estimates beats failing every later request.

use std::sync::{Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
