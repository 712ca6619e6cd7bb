//! Memory of another process from `/proc/<pid>/status` (the peers of the
//! side-by-side benchmark are separate processes, Go or Rust alike).

/// A `kB` field (`VmRSS`, `VmHWM`, …) of a `/proc/<pid>/status` text, in bytes.
pub fn parse_status_kb(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kb = rest.split_whitespace().next()?.parse::<u64>().ok()?;
        Some(kb * 1024)
    })
}

fn status_field(pid: u32, field: &str) -> Option<u64> {
    parse_status_kb(
        &std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
        field,
    )
}

/// Resident memory of `pid` now, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS")
}

/// The peak resident memory of `pid` so far, in bytes.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    status_field(pid, "VmHWM")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kb_fields_are_bytes() {
        let text = "Name:\tepp\nVmHWM:\t   65536 kB\nVmRSS:\t   23552 kB\nThreads:\t12\n";
        assert_eq!(parse_status_kb(text, "VmRSS"), Some(23_552 * 1024));
        assert_eq!(parse_status_kb(text, "VmHWM"), Some(65_536 * 1024));
        assert_eq!(parse_status_kb(text, "VmSwap"), None);
        assert_eq!(parse_status_kb(text, "Vm"), None);
    }

    #[test]
    fn this_process_has_resident_memory() {
        let me = std::process::id();
        assert!(rss_bytes(me).is_some_and(|b| b > 0));
        assert!(peak_rss_bytes(me) >= rss_bytes(me));
    }
}
