//! Small string helpers shared by the classifiers.
//!
//! Regex match offsets are byte offsets, while context windows are cut at fixed
//! byte distances; these helpers keep every slice on a char boundary so that no
//! input, however odd its UTF-8, can make a classifier panic.

/// Largest char boundary `<= i` (clamped to the string length).
pub(crate) fn floor_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Smallest char boundary `>= i` (clamped to the string length).
pub(crate) fn ceil_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// Up to `n` bytes of `s` that end at `pos`.
pub(crate) fn before(s: &str, pos: usize, n: usize) -> &str {
    let end = floor_boundary(s, pos);
    let start = ceil_boundary(s, end.saturating_sub(n));
    &s[start..end]
}

/// Up to `n` bytes of `s` that start at `pos`.
pub(crate) fn after(s: &str, pos: usize, n: usize) -> &str {
    let start = ceil_boundary(s, pos);
    let end = floor_boundary(s, start.saturating_add(n));
    &s[start..end]
}

/// The char just before byte offset `pos`.
pub(crate) fn prev_char(s: &str, pos: usize) -> Option<char> {
    s[..floor_boundary(s, pos)].chars().next_back()
}

/// The char starting at byte offset `pos`.
pub(crate) fn next_char(s: &str, pos: usize) -> Option<char> {
    s[ceil_boundary(s, pos)..].chars().next()
}

/// Shannon entropy of the byte distribution, in bits per byte.
pub(crate) fn shannon_entropy(s: &str) -> f64 {
    if s.is_empty() {
        return 0.0;
    }
    let mut counts = [0u32; 256];
    for b in s.bytes() {
        counts[usize::from(b)] += 1;
    }
    let len = s.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / len;
            -p * p.log2()
        })
        .sum()
}

/// Number of distinct character classes (lower, upper, digit, other) present.
pub(crate) fn char_classes(s: &str) -> usize {
    let lower = s.bytes().any(|b| b.is_ascii_lowercase());
    let upper = s.bytes().any(|b| b.is_ascii_uppercase());
    let digit = s.bytes().any(|b| b.is_ascii_digit());
    let other = s.chars().any(|c| !c.is_ascii_alphanumeric());
    [lower, upper, digit, other]
        .into_iter()
        .filter(|&x| x)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_respect_char_boundaries() {
        let s = "héllo wörld ✓ end";
        for pos in 0..=s.len() + 3 {
            for n in 0..8 {
                let _ = before(s, pos, n);
                let _ = after(s, pos, n);
                let _ = prev_char(s, pos);
                let _ = next_char(s, pos);
            }
        }
        assert_eq!(before("abcdef", 4, 2), "cd");
        assert_eq!(after("abcdef", 4, 10), "ef");
    }

    #[test]
    fn entropy_orders_random_above_repetitive() {
        assert_eq!(shannon_entropy(""), 0.0);
        assert_eq!(shannon_entropy("aaaa"), 0.0);
        assert!((shannon_entropy("abab") - 1.0).abs() < 1e-9);
        assert!(shannon_entropy("q8Zr2LmX9vBt4KpW7sYc1NdE5hJg3FaU") > 4.5);
    }

    #[test]
    fn classes() {
        assert_eq!(char_classes("abc"), 1);
        assert_eq!(char_classes("aB3"), 3);
        assert_eq!(char_classes("aB3!"), 4);
    }
}
