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
pub(crate) fn xxh64(data: &[u8]) -> u64 {
    xxh64_seeded(data, 0)
}

/// XXH64 of `data` with `seed`.
pub(crate) fn xxh64_seeded(data: &[u8], seed: u64) -> u64 {
    let len = data.len();
    let mut i = 0;
    let mut h = if len >= 32 {
        let (mut v1, mut v2, mut v3, mut v4) = (
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        );
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
        seed.wrapping_add(P5)
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
        h = (h ^ (b as u64).wrapping_mul(P5))
            .rotate_left(11)
            .wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// Bytes per checksummed block. A partial read verifies only the blocks it touches, so
/// resharding never has to read a whole saved tensor just to check it.
pub(crate) const BLOCK_BYTES: usize = 4 << 20;

/// Number of blocks of a tensor of `nbytes` (an empty tensor has none).
pub(crate) fn num_blocks(nbytes: usize) -> usize {
    nbytes.div_ceil(BLOCK_BYTES)
}

/// The block checksums of `data`, as 16 lowercase hex digits each, concatenated.
/// `bind` is the chunk's [`chunk_binding`] (0: fo 0.1.0's unbound checksums).
pub(crate) fn block_hex(data: &[u8], bind: u64) -> String {
    data.chunks(BLOCK_BYTES)
        .enumerate()
        .map(|(k, b)| block_sum(b, bind, k))
        .collect()
}

/// The checksum of block `k` of a chunk, as stored: 16 lowercase hex digits.
pub(crate) fn block_sum(bytes: &[u8], bind: u64, k: usize) -> String {
    let seed = if bind == 0 {
        0
    } else {
        xxh64_seeded(&(k as u64).to_le_bytes(), bind)
    };
    format!("{:016x}", xxh64_seeded(bytes, seed))
}

/// The seed binding a chunk's block checksums to where its data belongs: its key, dtype,
/// shape and global offset. Moving data between chunks, or editing where a chunk goes,
/// makes every block's checksum fail even where the bytes themselves are intact.
pub(crate) fn chunk_binding(
    key: &str,
    dtype: &str,
    shape: &[usize],
    global_offset: &[usize],
) -> u64 {
    let s = serde_json::to_string(&(key, dtype, shape, global_offset)).unwrap();
    xxh64_seeded(s.as_bytes(), 0x666f_2d63_6b70_7432) | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_published_xxh64_vectors() {
        assert_eq!(xxh64(b""), 0xEF46DB3751D8E999);
        assert_eq!(xxh64(b"a"), 0xD24EC4F1A98C6E5B);
        assert_eq!(xxh64(b"abc"), 0x44BC2CF5AD770999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition"),
            0xFBCEA83C8A378BF1
        );
        // Seeded vectors, from the Python `xxhash` package (the reference C library).
        assert_eq!(xxh64_seeded(b"", 1), 0xD5AFBA1336A3BE4B);
        assert_eq!(xxh64_seeded(b"abc", 1), 0xBEA9CA8199328908);
        let bytes: Vec<u8> = (0..40).collect();
        assert_eq!(xxh64_seeded(&bytes, 0x9E3779B1), 0x611D9E09BC23B46A);
    }

    #[test]
    fn bound_checksums_depend_on_placement() {
        let d = [1u8, 2, 3, 4];
        let a = chunk_binding("k", "F32", &[1], &[0]);
        assert_ne!(
            block_hex(&d, a),
            block_hex(&d, chunk_binding("k", "F32", &[1], &[1]))
        );
        assert_ne!(
            block_hex(&d, a),
            block_hex(&d, chunk_binding("k", "I32", &[1], &[0]))
        );
        assert_ne!(
            block_hex(&d, a),
            block_hex(&d, chunk_binding("j", "F32", &[1], &[0]))
        );
        assert_eq!(block_hex(&d, 0), format!("{:016x}", xxh64(&d)));
    }

    #[test]
    fn block_checksums_split_large_data() {
        let data = vec![7u8; BLOCK_BYTES + 5];
        let hex = block_hex(&data, 0);
        assert_eq!(hex.len(), 32);
        assert_eq!(num_blocks(data.len()), 2);
        assert_eq!(&hex[16..], format!("{:016x}", xxh64(&[7u8; 5])));
        assert_eq!(block_hex(&[], 7), "");
    }
}
