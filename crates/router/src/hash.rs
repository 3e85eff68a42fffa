//! The hash that routes string keys: 64-bit FNV-1a over the key's UTF-8 bytes.
//!
//! Stable by definition (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`, see
//! <http://www.isthe.com/chongo/tech/comp/fnv/>), independent of platform, Rust version
//! and process, so any client in any language can route the same way. Not for untrusted
//! keys where an attacker could aim many keys at one shard.

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`.
pub const fn key_hash(bytes: &[u8]) -> u64 {
    let mut hash = OFFSET_BASIS;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(PRIME);
        i += 1;
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::key_hash;

    #[test]
    fn published_test_vectors() {
        // From the FNV reference test suite.
        assert_eq!(key_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(key_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(key_hash(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
