//! What the host says about itself that fo sizes things by: the memory available now.
//! (Linux's `MemAvailable`; None where the host does not say.)

/// Bytes of memory the kernel says are available now (`MemAvailable` in /proc/meminfo).
pub fn available_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn linux_reports_available_memory() {
        let a = super::available_memory().expect("Linux has MemAvailable");
        assert!(a > 0);
    }
}
