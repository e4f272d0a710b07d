use std::collections::BTreeMap;

/// `--name value` and `--switch` flags, plus positional arguments.
#[derive(Debug, Default)]
pub struct Flags {
    values: BTreeMap<String, String>,
    switches: Vec<String>,
    pub positional: Vec<String>,
}

impl Flags {
    /// `--x=v` and `--x v` both work; a `--x` followed by another flag (or nothing) is a switch.
    pub fn parse(args: &[String]) -> Result<Flags, String> {
        let mut f = Flags::default();
        let mut i = 0;
        while i < args.len() {
            let a = &args[i];
            if let Some(name) = a.strip_prefix("--") {
                if let Some((k, v)) = name.split_once('=') {
                    f.values.insert(k.to_string(), v.to_string());
                } else if i + 1 < args.len() && !args[i + 1].starts_with("--") {
                    f.values.insert(name.to_string(), args[i + 1].clone());
                    i += 1;
                } else {
                    f.switches.push(name.to_string());
                }
            } else {
                f.positional.push(a.clone());
            }
            i += 1;
        }
        Ok(f)
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    pub fn require(&self, name: &str) -> Result<&str, String> {
        self.get(name).ok_or_else(|| format!("missing --{name}"))
    }

    pub fn switch(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }

    /// A parsed value with a default.
    pub fn parse_or<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("--{name}: cannot parse {v:?}")),
        }
    }

    /// A comma-separated list (`--shape 10,7`).
    pub fn list<T: std::str::FromStr>(&self, name: &str) -> Result<Vec<T>, String> {
        let v = self.require(name)?;
        if v.is_empty() {
            return Ok(vec![]);
        }
        v.split(',').map(|s| s.trim().parse().map_err(|_| format!("--{name}: cannot parse {s:?} in {v:?}"))).collect()
    }
}
