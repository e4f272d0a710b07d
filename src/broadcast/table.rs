//! The table rank 0 broadcasts before any data: every key with its dtype and global
//! shape, sorted by key. Encoded as little-endian binary:
//! `u32 count`, then per entry `u32 key_len, key, i32 dtype, u32 ndim, u64 dims...`.
use std::collections::BTreeMap;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::TensorView;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Rank 0's entries, sorted by key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table(pub Vec<Entry>);

impl Table {
    /// The table of rank 0's full state dict; a key given twice is an error.
    pub fn from_full(full: &[(String, TensorView)]) -> Result<Table> {
        let mut m = BTreeMap::new();
        for (i, (k, t)) in full.iter().enumerate() {
            let e = Entry {
                key: k.clone(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
            };
            if m.insert(k.clone(), (i, e)).is_some() {
                return Err(Error::invalid(
                    format!("full[{i}].key"),
                    format!("key {k:?} appears twice in rank 0's state dict"),
                ));
            }
        }
        Ok(Table(m.into_values().map(|(_, e)| e).collect()))
    }

    /// The index of `key`, if rank 0 has it.
    pub fn find(&self, key: &str) -> Option<usize> {
        self.0.binary_search_by(|e| e.key.as_str().cmp(key)).ok()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend((self.0.len() as u32).to_le_bytes());
        for e in &self.0 {
            v.extend((e.key.len() as u32).to_le_bytes());
            v.extend(e.key.as_bytes());
            v.extend(e.dtype.code().to_le_bytes());
            v.extend((e.shape.len() as u32).to_le_bytes());
            for &d in &e.shape {
                v.extend((d as u64).to_le_bytes());
            }
        }
        v
    }

    pub fn decode(b: &[u8]) -> Result<Table> {
        let bad = || Error::Comm("the table received from rank 0 is malformed".into());
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = b
                .get(at..at.checked_add(n).ok_or_else(bad)?)
                .ok_or_else(bad)?;
            at += n;
            Ok(s)
        };
        let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap());
        let count = u32_(take(4)?) as usize;
        let mut out = Vec::with_capacity(count.min(1 << 20));
        for _ in 0..count {
            let klen = u32_(take(4)?) as usize;
            let key = String::from_utf8(take(klen)?.to_vec()).map_err(|_| bad())?;
            let dtype = DType::from_code(
                i32::from_le_bytes(take(4)?.try_into().unwrap()),
                "table dtype",
            )
            .map_err(|_| bad())?;
            let ndim = u32_(take(4)?) as usize;
            let shape = (0..ndim)
                .map(|_| take(8).map(|s| u64::from_le_bytes(s.try_into().unwrap()) as usize))
                .collect::<Result<Vec<_>>>()?;
            out.push(Entry { key, dtype, shape });
        }
        if at != b.len() {
            return Err(bad());
        }
        Ok(Table(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_keys_round_trips_and_rejects_duplicates() {
        let mut a = [0f32; 6];
        let mut b = [0u8; 1];
        let t = |p: *mut u8, d, s: &[i64]| unsafe { TensorView::host(p, d, s, None, "t").unwrap() };
        let full = vec![
            (
                "z.weight".to_string(),
                t(a.as_mut_ptr() as *mut u8, DType::F32, &[2, 3]),
            ),
            ("a.flag".to_string(), t(b.as_mut_ptr(), DType::Bool, &[])),
        ];
        let table = Table::from_full(&full).unwrap();
        assert_eq!(table.0[0].key, "a.flag");
        assert_eq!(table.find("z.weight"), Some(1));
        assert_eq!(Table::decode(&table.encode()).unwrap(), table);
        assert!(Table::decode(&table.encode()[..10]).is_err());
        let dup = vec![full[0].clone(), full[0].clone()];
        let e = Table::from_full(&dup).unwrap_err();
        assert!(e.to_string().contains("appears twice"), "{e}");
    }
}
