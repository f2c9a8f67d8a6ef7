//! CPU pinning: an engine's worker threads (and, through [`pin_current_thread`], any thread) can be
//! confined to a set of cores, so that the edge and the cloud sharing one machine in a benchmark do
//! not steal each other's core.

use std::fmt;
use std::str::FromStr;

/// A set of CPU ids (0..256). Empty means "no pinning".
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuSet {
    bits: [u64; 4],
}

impl CpuSet {
    /// One core for the edge and another for the verifier: the first two this process may use
    /// (no pinning with fewer).
    pub fn edge_and_cloud() -> (CpuSet, CpuSet) {
        let allowed: Vec<usize> = CpuSet::allowed()
            .map(|s| s.cpus().collect())
            .unwrap_or_default();
        let one = |c: usize| -> CpuSet {
            let mut s = CpuSet::default();
            let _ = s.insert(c);
            s
        };
        match allowed[..] {
            [e, c, ..] => (one(e), one(c)),
            _ => (CpuSet::default(), CpuSet::default()),
        }
    }

    pub const MAX_CPUS: usize = 256;

    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|&w| w == 0)
    }

    pub fn insert(&mut self, cpu: usize) -> Result<(), String> {
        if cpu >= Self::MAX_CPUS {
            return Err(format!(
                "cpu {cpu} is beyond the largest supported id {}",
                Self::MAX_CPUS - 1
            ));
        }
        self.bits[cpu / 64] |= 1 << (cpu % 64);
        Ok(())
    }

    pub fn contains(&self, cpu: usize) -> bool {
        cpu < Self::MAX_CPUS && self.bits[cpu / 64] & (1 << (cpu % 64)) != 0
    }

    pub fn cpus(&self) -> impl Iterator<Item = usize> + '_ {
        (0..Self::MAX_CPUS).filter(|&c| self.contains(c))
    }

    pub fn len(&self) -> usize {
        self.bits.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The CPUs this process may run on.
    pub fn allowed() -> Result<Self, String> {
        imp::allowed()
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuSet({self})")
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list: Vec<String> = self.cpus().map(|c| c.to_string()).collect();
        f.write_str(&list.join(","))
    }
}

/// Parses `taskset -c` lists: `0`, `0,2`, `0-3`, `0-1,4`.
impl FromStr for CpuSet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut set = CpuSet::default();
        for part in s.split(',').map(str::trim) {
            let num = |t: &str| {
                t.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{t:?} in {s:?} is not a CPU id (a list like 0,2 or 0-3)"))
            };
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (num(a)?, num(b)?);
                    if a > b {
                        return Err(format!("{part:?} in {s:?} is an empty range"));
                    }
                    for c in a..=b {
                        set.insert(c)?;
                    }
                }
                None => set.insert(num(part)?)?,
            }
        }
        Ok(set)
    }
}

/// Check that every CPU of `set` is one this process may use.
pub fn check(set: &CpuSet) -> Result<(), String> {
    if set.is_empty() {
        return Ok(());
    }
    let allowed = CpuSet::allowed()?;
    match set.cpus().find(|&c| !allowed.contains(c)) {
        Some(c) => Err(format!(
            "cpu {c} is not available to this process (allowed: {allowed})"
        )),
        None => Ok(()),
    }
}

/// Confine the calling thread (and threads it starts later) to `set`. An empty set changes nothing.
pub fn pin_current_thread(set: &CpuSet) -> Result<(), String> {
    if set.is_empty() {
        return Ok(());
    }
    check(set)?;
    imp::pin(set)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::CpuSet;

    pub fn pin(set: &CpuSet) -> Result<(), String> {
        // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it; sched_setaffinity
        // reads `size_of::<cpu_set_t>()` bytes of it. Pid 0 is the calling thread.
        unsafe {
            let mut raw: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_ZERO(&mut raw);
            for c in set.cpus() {
                libc::CPU_SET(c, &mut raw);
            }
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw) != 0 {
                return Err(format!(
                    "sched_setaffinity({set}): {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
        Ok(())
    }

    pub fn allowed() -> Result<CpuSet, String> {
        // SAFETY: as above; sched_getaffinity fills the zeroed set.
        unsafe {
            let mut raw: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut raw) != 0 {
                return Err(format!(
                    "sched_getaffinity: {}",
                    std::io::Error::last_os_error()
                ));
            }
            let mut set = CpuSet::default();
            for c in 0..CpuSet::MAX_CPUS.min(libc::CPU_SETSIZE as usize) {
                if libc::CPU_ISSET(c, &raw) {
                    set.insert(c)?;
                }
            }
            Ok(set)
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::CpuSet;

    pub fn pin(_set: &CpuSet) -> Result<(), String> {
        Err("CPU pinning is only supported on Linux".into())
    }

    pub fn allowed() -> Result<CpuSet, String> {
        Err("CPU pinning is only supported on Linux".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_taskset_lists_and_refuses_bad_ones() {
        let s: CpuSet = "0-2,5".parse().unwrap();
        assert_eq!(s.cpus().collect::<Vec<_>>(), vec![0, 1, 2, 5]);
        assert_eq!(s.to_string(), "0,1,2,5");
        assert!("".parse::<CpuSet>().unwrap_err().contains("not a CPU id"));
        assert!("3-1".parse::<CpuSet>().unwrap_err().contains("empty range"));
        assert!("x".parse::<CpuSet>().unwrap_err().contains("\"x\""));
        assert!("5000".parse::<CpuSet>().unwrap_err().contains("beyond"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn pins_a_thread_to_one_allowed_cpu() {
        let allowed = CpuSet::allowed().unwrap();
        let first = allowed.cpus().next().unwrap();
        let one: CpuSet = first.to_string().parse().unwrap();
        std::thread::spawn(move || {
            pin_current_thread(&one).unwrap();
            assert_eq!(CpuSet::allowed().unwrap(), one);
        })
        .join()
        .unwrap();
        let missing: CpuSet = "255".parse().unwrap();
        assert!(pin_current_thread(&missing)
            .unwrap_err()
            .contains("not available"));
    }
}
