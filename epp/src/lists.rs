//! Comma-separated values, as annotations, headers and engine metric labels
//! carry lists (`"a, b,,c"`).

/// The entries of `s`, trimmed, empty ones dropped.
pub(crate) fn comma_separated(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|e| !e.is_empty())
}

#[cfg(test)]
mod tests {
    use super::comma_separated;

    #[test]
    fn trims_and_drops_empty_entries() {
        let got: Vec<_> = comma_separated(" a, b,,c , ").collect();
        assert_eq!(got, ["a", "b", "c"]);
        assert_eq!(comma_separated("").count(), 0);
        assert_eq!(comma_separated(" , ").count(), 0);
    }
}
