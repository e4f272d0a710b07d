//! XXH64 (seed 0), the checksum stored per block of every tensor fo writes. Written out
//! here because the crate has no hashing dependency; it is the reference algorithm,
//! checked against the published test vectors below.
const P1: u64 = 11400714785074694791;
const P2: u64 = 14029467366897019727;
const P3: u64 = 1609587929392839161;
const P4: u64 = 9650029242287828579;
const P5: u64 = 2870177450012600261;

fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn merge(acc: u64, val: u64) -> u64 {
    (acc ^ round(0, val)).wrapping_mul(P1).wrapping_add(P4)
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
}

/// XXH64 of `data` with seed 0.
pub fn xxh64(data: &[u8]) -> u64 {
    let len = data.len();
    let mut i = 0;
    let mut h = if len >= 32 {
        let (mut v1, mut v2, mut v3, mut v4) = (P1.wrapping_add(P2), P2, 0u64, 0u64.wrapping_sub(P1));
        for stripe in data[..len - len % 32].chunks_exact(32) {
            v1 = round(v1, u64_at(stripe, 0));
            v2 = round(v2, u64_at(stripe, 8));
            v3 = round(v3, u64_at(stripe, 16));
            v4 = round(v4, u64_at(stripe, 24));
        }
        i = len - len % 32;
        let h = v1
            .rotate_left(1)
            .wrapping_add(v2.rotate_left(7))
            .wrapping_add(v3.rotate_left(12))
            .wrapping_add(v4.rotate_left(18));
        merge(merge(merge(merge(h, v1), v2), v3), v4)
    } else {
        P5
    };
    h = h.wrapping_add(len as u64);
    while i + 8 <= len {
        h = (h ^ round(0, u64_at(data, i)))
            .rotate_left(27)
            .wrapping_mul(P1)
            .wrapping_add(P4);
        i += 8;
    }
    if i + 4 <= len {
        let k = u32::from_le_bytes(data[i..i + 4].try_into().unwrap()) as u64;
        h = (h ^ k.wrapping_mul(P1))
            .rotate_left(23)
            .wrapping_mul(P2)
            .wrapping_add(P3);
        i += 4;
    }
    for &b in &data[i..] {
        h = (h ^ (b as u64).wrapping_mul(P5)).rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// Bytes per checksummed block. A partial read verifies only the blocks it touches, so
/// resharding never has to read a whole saved tensor just to check it.
pub const BLOCK_BYTES: usize = 4 << 20;

/// Number of blocks of a tensor of `nbytes` (an empty tensor has none).
pub fn num_blocks(nbytes: usize) -> usize {
    nbytes.div_ceil(BLOCK_BYTES)
}

/// The block checksums of `data`, as 16 lowercase hex digits each, concatenated.
pub fn block_hex(data: &[u8]) -> String {
    data.chunks(BLOCK_BYTES).map(|b| format!("{:016x}", xxh64(b))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_published_xxh64_vectors() {
        assert_eq!(xxh64(b""), 0xEF46DB3751D8E999);
        assert_eq!(xxh64(b"a"), 0xD24EC4F1A98C6E5B);
        assert_eq!(xxh64(b"abc"), 0x44BC2CF5AD770999);
        assert_eq!(xxh64(b"Nobody inspects the spammish repetition"), 0xFBCEA83C8A378BF1);
    }

    #[test]
    fn block_checksums_split_large_data() {
        let data = vec![7u8; BLOCK_BYTES + 5];
        let hex = block_hex(&data);
        assert_eq!(hex.len(), 32);
        assert_eq!(num_blocks(data.len()), 2);
        assert_eq!(&hex[16..], format!("{:016x}", xxh64(&[7u8; 5])));
        assert_eq!(block_hex(&[]), "");
    }
}
