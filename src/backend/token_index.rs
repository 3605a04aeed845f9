//! The embedding backward's token index, built on the host from the host copy of the tokens that the GPU
//! backends keep: it lets one thread own each (token, channel) of the gradient and sum that token's
//! positions in `(b, t)` order, the CPU specification's order, with no atomics.

/// The embedding backward's token index of `toks` (ids below `v`): the positions grouped by token, in
/// `(b, t)` order within a token, as `[rows | starts | positions]` (u32): the `u` distinct tokens in
/// increasing order, where each one's positions start (plus the end), then the positions. Returns `u` too.
pub(crate) fn token_index(toks: &[u32], v: usize) -> (usize, Vec<u32>) {
    assert!(
        toks.iter().all(|&x| (x as usize) < v),
        "token id out of the vocabulary of {v}"
    );
    let n = toks.len();
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by_key(|&i| (toks[i as usize], i));
    let mut rows = Vec::new();
    let mut starts = Vec::new();
    for (j, &i) in order.iter().enumerate() {
        let tok = toks[i as usize];
        if rows.last() != Some(&tok) {
            rows.push(tok);
            starts.push(j as u32);
        }
    }
    starts.push(n as u32);
    let u = rows.len();
    let mut index = rows;
    index.extend_from_slice(&starts);
    index.extend_from_slice(&order);
    (u, index)
}
