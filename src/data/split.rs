//! Each rank's share of a step's global batch, and the micro-batches it runs them in.
//!
//! A global batch of G windows (sequences) is divided into one share per rank ([`BatchSplit`]). With equal
//! shares that are whole micro-batches of the same size on every rank (G = world × batch × grad-accum, the
//! layout before splits existed), rank r's micro-step k is the slice at `(k·world + r)·batch`
//! ([`split_for_rank`]), which keeps the bits of runs before uneven shares. Otherwise rank r takes the
//! contiguous slice after ranks `0..r`'s shares and runs it as near-equal micro-batches of at most its own
//! batch size. Either way the ranks together cover the global batch exactly once, whatever the timing.

use super::sampler::split_for_rank;
use super::{DataError, Result};

/// How a global batch is divided among the ranks.
#[derive(Clone, Debug, PartialEq)]
pub enum BatchSplit {
    /// Near-equal shares: the first `G % world` ranks take one sequence more.
    Even,
    /// Shares in proportion to one positive weight per rank (`--batch-split 3,1`).
    Weights(Vec<f64>),
    /// Shares that follow each rank's measured speed (`--batch-split auto`, [`crate::trainer::auto_split`]):
    /// even at the start, then re-split by the ranks together at agreed steps.
    Auto,
}

impl BatchSplit {
    /// `even`, `auto`, or comma-separated positive weights.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let text = text.trim();
        match text {
            "even" => return Ok(BatchSplit::Even),
            "auto" => return Ok(BatchSplit::Auto),
            _ => {}
        }
        let weights = text
            .split(',')
            .map(|w| match w.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(format!(
                    "weight {w:?} in --batch-split {text:?} is not a positive number (give `even`, `auto`, or \
                     one weight per rank such as 3,1)"
                )),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(BatchSplit::Weights(weights))
    }
}

impl std::fmt::Display for BatchSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchSplit::Even => write!(f, "even"),
            BatchSplit::Auto => write!(f, "auto"),
            BatchSplit::Weights(w) => {
                let w: Vec<String> = w.iter().map(|x| x.to_string()).collect();
                write!(f, "{}", w.join(","))
            }
        }
    }
}

/// Sequences per rank for a global batch of `global` over `world` ranks: they sum to `global`, and each is
/// at least one. `auto` starts from the even shares. Weighted shares take the floor of each rank's quota, then one more for the largest
/// remainders (ties to the lower rank): the same integers on every rank.
pub fn shares(global: usize, world: usize, split: &BatchSplit) -> Result<Vec<usize>> {
    let invalid = |why: String| Err(DataError::InvalidArgument(why));
    if world == 0 {
        return invalid("a global batch needs at least one rank".into());
    }
    if global < world {
        return invalid(format!(
            "a global batch of {global} sequences cannot give each of {world} ranks one (--global-batch)"
        ));
    }
    let weights = match split {
        BatchSplit::Even | BatchSplit::Auto => {
            return Ok((0..world)
                .map(|r| global / world + usize::from(r < global % world))
                .collect())
        }
        BatchSplit::Weights(w) => w,
    };
    if weights.len() != world {
        return invalid(format!(
            "--batch-split gives {} weights for {world} ranks; give one per rank",
            weights.len()
        ));
    }
    if let Some((rank, w)) = weights.iter().enumerate().find(|(_, w)| !(w.is_finite() && **w > 0.0)) {
        return invalid(format!(
            "--batch-split: rank {rank}'s weight {w} is not a positive number"
        ));
    }
    let total: f64 = weights.iter().sum();
    let quotas: Vec<f64> = weights.iter().map(|w| global as f64 * w / total).collect();
    let mut shares: Vec<usize> = quotas.iter().map(|q| q.floor() as usize).collect();
    let mut by_remainder: Vec<usize> = (0..world).collect();
    by_remainder.sort_by(|&a, &b| (quotas[b] - quotas[b].floor()).total_cmp(&(quotas[a] - quotas[a].floor())));
    let left = global.saturating_sub(shares.iter().sum());
    for &rank in by_remainder.iter().take(left) {
        shares[rank] += 1;
    }
    if let Some(rank) = shares.iter().position(|&n| n == 0) {
        return invalid(format!(
            "--batch-split {split}: rank {rank}'s weight {} gives it none of the {global} sequences of a global \
             batch; raise its weight or the global batch",
            weights[rank]
        ));
    }
    Ok(shares)
}

/// How one step's global batch is laid out over the ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchPlan {
    /// Sequences per step over all ranks.
    pub global: usize,
    /// Sequences per rank; they sum to `global`.
    pub shares: Vec<usize>,
    /// `Some((batch, grad_accum))` when every share is `grad_accum` micro-batches of `batch` on every rank:
    /// the micro-step-major layout and the averaging ring of equal shares.
    pub equal: Option<(usize, usize)>,
}

impl BatchPlan {
    /// The plan of a `world`-rank job: equal whole micro-batches when `split` is even and `global` is
    /// `world × batch × grad_accum`, else the shares of [`shares`].
    pub fn new(global: usize, world: usize, split: &BatchSplit, batch: usize, grad_accum: usize) -> Result<Self> {
        let shares = shares(global, world, split)?;
        let whole = Some(global) == world.checked_mul(batch).and_then(|n| n.checked_mul(grad_accum));
        let equal = (*split == BatchSplit::Even && whole).then_some((batch, grad_accum));
        Ok(BatchPlan { global, shares, equal })
    }

    /// A plan of given uneven shares (an `auto` re-split, or the shares a checkpoint recorded); they must
    /// sum to `global` with at least one sequence each.
    pub fn with_shares(global: usize, shares: Vec<usize>) -> Result<Self> {
        if shares.is_empty() || shares.contains(&0) || shares.iter().sum::<usize>() != global {
            return Err(DataError::InvalidArgument(format!(
                "shares {shares:?} do not give each rank at least one of a global batch of {global} sequences"
            )));
        }
        Ok(BatchPlan {
            global,
            shares,
            equal: None,
        })
    }

    /// Rank `rank`'s micro-batches of one step's `windows` (`[global]`): each at most `batch` windows (this
    /// rank's batch size), near-equal in size.
    pub fn micro_batches(&self, windows: &[u64], rank: usize, batch: usize) -> Result<Vec<Vec<u64>>> {
        let world = self.shares.len();
        if windows.len() != self.global || rank >= world || batch == 0 {
            return Err(DataError::InvalidArgument(format!(
                "{} windows for rank {rank} of {world} at batch size {batch}: the plan is for a global batch of {}",
                windows.len(),
                self.global
            )));
        }
        if let Some((b, k)) = self.equal {
            return split_for_rank(windows, rank, world, b, k);
        }
        let start: usize = self.shares[..rank].iter().sum();
        let mine = &windows[start..start + self.shares[rank]];
        let count = mine.len().div_ceil(batch);
        let (size, longer) = (mine.len() / count, mine.len() % count);
        let mut at = 0;
        Ok((0..count)
            .map(|i| {
                let len = size + usize::from(i < longer);
                at += len;
                mine[at - len..at].to_vec()
            })
            .collect())
    }

    /// The largest micro-batch any step gives rank `rank` at batch size `batch`: what its activations hold.
    pub fn largest_micro_batch(&self, rank: usize, batch: usize) -> usize {
        match self.equal {
            Some((b, _)) => b,
            None => {
                let n = self.shares[rank];
                n.div_ceil(n.div_ceil(batch))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_apportion_the_global_batch_exactly() {
        assert_eq!(shares(8, 2, &BatchSplit::Weights(vec![3.0, 1.0])).unwrap(), [6, 2]);
        assert_eq!(
            shares(16, 3, &BatchSplit::Weights(vec![5.0, 2.0, 1.0])).unwrap(),
            [10, 4, 2]
        );
        // Quotas 5.33, 2.67, 2: the largest remainder takes the one left over.
        assert_eq!(
            shares(10, 3, &BatchSplit::Weights(vec![8.0, 4.0, 3.0])).unwrap(),
            [5, 3, 2]
        );
        assert_eq!(shares(7, 3, &BatchSplit::Even).unwrap(), [3, 2, 2]);
    }

    #[test]
    fn bad_splits_name_the_rank_and_the_value() {
        let err = |g, w, s: &str| shares(g, w, &BatchSplit::parse(s).unwrap()).unwrap_err().to_string();
        assert!(err(8, 3, "3,1").contains("2 weights for 3 ranks"));
        assert!(err(4, 2, "1000,1").contains("rank 1's weight 1 gives it none"));
        assert!(shares(1, 2, &BatchSplit::Even).unwrap_err().to_string().contains("one"));
        for bad in ["0,1", "-1,2", "x,1", "1,,2", "inf,1"] {
            let e = BatchSplit::parse(bad).unwrap_err();
            assert!(e.contains("not a positive number"), "{bad}: {e}");
        }
    }

    /// Every window of the global batch goes to exactly one micro-batch of one rank, in near-equal
    /// micro-batches of at most the rank's batch size.
    #[test]
    fn micro_batches_cover_the_global_batch_once() {
        let windows: Vec<u64> = (100..124).collect();
        for (split, batches) in [("3,1", &[4, 4][..]), ("5,2,1", &[3, 2, 4]), ("even", &[5, 5, 5])] {
            let split = BatchSplit::parse(split).unwrap();
            let world = batches.len();
            let plan = BatchPlan::new(24, world, &split, 4, 2).unwrap();
            let mut seen = Vec::new();
            for (rank, &b) in batches.iter().enumerate() {
                let micro = plan.micro_batches(&windows, rank, b).unwrap();
                let sizes: Vec<usize> = micro.iter().map(Vec::len).collect();
                assert!(sizes.iter().all(|&n| n <= b && n + 1 >= sizes[0]), "{sizes:?}");
                assert!(sizes.iter().all(|&n| n <= plan.largest_micro_batch(rank, b)));
                assert_eq!(sizes.iter().sum::<usize>(), plan.shares[rank]);
                seen.extend(micro.into_iter().flatten());
            }
            seen.sort();
            assert_eq!(seen, windows);
        }
    }

    /// Equal whole micro-batches keep the layout of runs before uneven shares.
    #[test]
    fn equal_shares_keep_the_micro_step_major_layout() {
        let windows: Vec<u64> = (0..12).collect();
        let plan = BatchPlan::new(12, 2, &BatchSplit::Even, 3, 2).unwrap();
        assert_eq!(plan.equal, Some((3, 2)));
        for rank in 0..2 {
            assert_eq!(
                plan.micro_batches(&windows, rank, 3).unwrap(),
                split_for_rank(&windows, rank, 2, 3, 2).unwrap()
            );
        }
        assert_eq!(BatchPlan::new(13, 2, &BatchSplit::Even, 3, 2).unwrap().equal, None);
    }
}
