//! Gradient buckets and who owns which elements of them.
//!
//! Backward finishes the parameters from the end of the flat layout towards its start: the final layer
//! norm, then each block from the last to the first, then the position and token embeddings (the tied
//! `wte` only after the embedding backward). So the finished gradient is always a suffix of the flat
//! buffer, and buckets are cut at tensor boundaries walking the layout backwards: a bucket is ready once
//! that suffix reaches its first element.
//!
//! In sharded (ZeRO-1) mode each bucket is reduce-scattered on its own, so a rank owns the part of every
//! bucket the collective's ownership map gives it ([`Owner`]: chunk `r` of the bucket's length on the flat
//! ring, a chunk of a host chunk on the two-level one). That one map decides the moments a rank keeps, the
//! slices its AdamW updates, its share of the gradient norm, what it contributes to the parameter
//! all-gather, and how saved moments are gathered and re-cut.

use super::UpdateMode;
use crate::collective::Owner;
use crate::model::{ModelConfig, ParamLayout};
use std::ops::Range;

/// Buckets of whole tensors, in the order backward finishes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    /// Contiguous flat ranges, descending: the first is the end of the layout, the last starts at 0.
    pub buckets: Vec<Range<usize>>,
}

impl BucketPlan {
    /// Walks the tensors from the last to the first, closing a bucket once it holds at least
    /// `bucket_elems` elements (as DDP fills `bucket_cap_mb`): a bucket smaller than a tensor gives one
    /// bucket per tensor, one larger than the model a single bucket.
    ///
    /// When the model takes more than one bucket, the embeddings (`wte`, `wpe`, first in the layout) start
    /// a bucket of their own. They are finished last, after the whole backward, so their bucket's
    /// collective can never overlap it; anything sharing it (the first block's tensors, finished earlier)
    /// would wait with them and lengthen the exposed tail.
    pub fn new(layout: &ParamLayout, bucket_elems: usize) -> Self {
        let bucket_elems = bucket_elems.max(1);
        if bucket_elems >= layout.total {
            return BucketPlan {
                buckets: std::iter::once(0..layout.total).collect(),
            };
        }
        let embeddings_end = layout.wpe + layout.specs[1].len;
        let mut buckets = Vec::new();
        let mut end = layout.total;
        for spec in layout.specs.iter().rev() {
            if spec.offset < embeddings_end && end > embeddings_end {
                buckets.push(embeddings_end..end);
                end = embeddings_end;
            }
            if end - spec.offset >= bucket_elems {
                buckets.push(spec.offset..end);
                end = spec.offset;
            }
        }
        if end > 0 {
            buckets.push(0..end);
        }
        BucketPlan { buckets }
    }

    /// The rank's part (under `owner`) of bucket `bucket` when it is reduce-scattered, as a flat range.
    pub fn owned_in(&self, bucket: usize, owner: &Owner) -> Range<usize> {
        let b = &self.buckets[bucket];
        let chunk = self.owned_within(bucket, owner);
        b.start + chunk.start..b.start + chunk.end
    }

    /// The same part as a range within the bucket (what the ring leaves reduced in the bucket's buffer).
    pub fn owned_within(&self, bucket: usize, owner: &Owner) -> Range<usize> {
        owner.range(self.buckets[bucket].len())
    }

    /// The flat ranges whose optimizer state the rank of `owner` keeps, ascending: everything for a
    /// replicated update or a single rank, its part of every bucket for a sharded one.
    pub fn owned(&self, update: UpdateMode, owner: &Owner) -> Vec<Range<usize>> {
        let total = self.buckets.first().map_or(0, |b| b.end);
        if update == UpdateMode::Replicated || owner.world() == 1 {
            return std::iter::once(0..total).collect();
        }
        let mut owned: Vec<_> = (0..self.buckets.len())
            .map(|i| self.owned_in(i, owner))
            .filter(|r| !r.is_empty())
            .collect();
        owned.reverse();
        owned
    }
}

/// Elements whose optimizer state rank `rank` of `world` keeps in a flat-ring run of `config` (see
/// [`BucketPlan::owned`]).
pub fn optimizer_elems(
    config: &ModelConfig,
    update: UpdateMode,
    bucket_elems: usize,
    world: usize,
    rank: usize,
) -> usize {
    let plan = BucketPlan::new(&ParamLayout::new(config), bucket_elems);
    owned_len(&plan.owned(update, &Owner::flat(world, rank)))
}

/// Elements in `ranges`.
pub fn owned_len(ranges: &[Range<usize>]) -> usize {
    ranges.iter().map(|r| r.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ParamLayout {
        ParamLayout::new(&ModelConfig::tiny())
    }

    #[test]
    fn buckets_cover_the_layout_backwards_at_tensor_boundaries() {
        let layout = tiny();
        let starts: Vec<usize> = layout.specs.iter().map(|s| s.offset).collect();
        for elems in [1, 100, 5_000, 40_000, layout.total, 10 * layout.total] {
            let plan = BucketPlan::new(&layout, elems);
            let mut end = layout.total;
            for b in &plan.buckets {
                assert_eq!(b.end, end, "contiguous, descending");
                assert!(starts.contains(&b.start), "cut at a tensor boundary");
                end = b.start;
            }
            assert_eq!(end, 0);
            // Every bucket reached the size but the last (what is left) and, with several buckets, the one
            // that ends where the embeddings end, which starts a bucket of their own.
            let embeddings_end = layout.specs[2].offset;
            for b in &plan.buckets[..plan.buckets.len() - 1] {
                assert!(b.len() >= elems || b.start == embeddings_end, "{b:?}");
            }
            if plan.buckets.len() > 1 {
                assert!(
                    plan.buckets.iter().any(|b| b.end == embeddings_end),
                    "embeddings on their own"
                );
                assert!(plan
                    .buckets
                    .iter()
                    .all(|b| b.start >= embeddings_end || b.end <= embeddings_end));
            }
        }
        assert_eq!(BucketPlan::new(&layout, 1).buckets.len(), layout.specs.len());
        // A bucket just smaller than the model: the embeddings alone, then the rest.
        let embeddings_end = layout.specs[2].offset;
        assert_eq!(
            BucketPlan::new(&layout, layout.total - 1).buckets,
            vec![embeddings_end..layout.total, 0..embeddings_end]
        );
        assert_eq!(
            BucketPlan::new(&layout, 10 * layout.total).buckets,
            vec![0..layout.total]
        );
    }

    #[test]
    fn sharded_ownership_partitions_every_bucket_over_the_ranks() {
        let layout = tiny();
        let plan = BucketPlan::new(&layout, 3_000);
        for world in 1..=4 {
            let mut seen = vec![0u8; layout.total];
            for rank in 0..world {
                let owned = plan.owned(UpdateMode::Sharded, &Owner::flat(world, rank));
                assert!(owned.windows(2).all(|w| w[0].end <= w[1].start), "ascending, disjoint");
                for r in owned {
                    seen[r].iter_mut().for_each(|s| *s += 1);
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "world {world}: every element owned once");
        }
        assert_eq!(
            plan.owned(UpdateMode::Replicated, &Owner::flat(3, 1)),
            vec![0..layout.total]
        );
    }
}
