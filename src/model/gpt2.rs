//! GPT-2 forward and backward, written once against the [`Backend`] trait (llm.c's structure, Hugging Face's
//! semantics): pre-LN blocks, GELU tanh, causal attention, learned positions, LM head tied to `wte`.

use super::layout::{BlockParams, ParamLayout};
use super::ModelConfig;
use crate::backend::{
    AddInplace, AddLayerNormForward, AttentionBackward, AttentionForward, AttentionSaving, AttentionShape, Backend,
    Checked, CrossEntropyBackward, CrossEntropyForward, CrossEntropyForwardBackward, EncoderBackward, EncoderForward,
    EncoderShape, GeluBackward, LayerNormBackward, LayerNormForward, LogitsShape, MatmulBackward, MatmulForward,
    MatmulGeluForward, MatmulShape, RowsShape, TokenView, View, WeightLayout,
};
use anyhow::{bail, Result};

/// Activations of one transformer block for a `[b, t]` batch.
#[derive(Clone, Copy, Debug)]
struct BlockActs {
    ln1: View,       // [b*t, c]
    ln1_mean: View,  // [b*t]
    ln1_rstd: View,  // [b*t]
    qkv: View,       // [b*t, 3c]
    att_saved: View, // saving.saved_len: what attention keeps for backward
    atty: View,      // [b*t, c]
    residual2: View, // [b*t, c]
    ln2: View,       // [b*t, c]
    ln2_mean: View,  // [b*t]
    ln2_rstd: View,  // [b*t]
    fch: View,       // [b*t, 4c]
    fch_gelu: View,  // [b*t, 4c]
    residual3: View, // [b*t, c] (block output)
}

/// Everything forward keeps for backward, plus backward's scratch, for one batch shape.
#[derive(Clone, Debug)]
struct Activations {
    b: usize,
    t: usize,
    whole: View,        // every f32 view below lies in this one allocation
    tokens: TokenView,  // [b*t]
    targets: TokenView, // [b*t]
    encoded: View,      // [b*t, c]
    blocks: Vec<BlockActs>,
    lnf: View,      // [b*t, c]
    lnf_mean: View, // [b*t]
    lnf_rstd: View, // [b*t]
    logits: View,   // [b*t, v]; overwritten by dlogits in backward
    losses: View,   // [b*t]
    // Backward scratch.
    dres: View,        // [b*t, c]: gradient of the residual stream
    dbtc: View,        // [b*t, c]
    d4c_a: View,       // [b*t, 4c]
    d4c_b: View,       // [b*t, 4c]
    dqkv: View,        // [b*t, 3c]
    att_scratch: View, // saving.scratch_len: attention backward's scratch
    /// What the backend's attention keeps, which sized `att_saved` and `att_scratch`.
    saving: AttentionSaving,
}

/// Carves consecutive views out of one allocation. With no allocation yet it only counts, so the same
/// carving code sizes the buffer and then fills it.
struct Carver {
    whole: Option<View>,
    next: usize,
}

impl Carver {
    fn take(&mut self, len: usize) -> View {
        let v = match self.whole {
            Some(whole) => whole.sub(self.next, len),
            None => View {
                buf: usize::MAX,
                offset: self.next,
                len,
            },
        };
        self.next += len;
        v
    }

    /// The allocation being carved (a placeholder while only counting).
    fn allocation(&self) -> View {
        self.whole.unwrap_or(View {
            buf: usize::MAX,
            offset: 0,
            len: 0,
        })
    }
}

impl Activations {
    fn new<B: Backend>(be: &mut B, cfg: &ModelConfig, b: usize, t: usize) -> Result<Self> {
        let saving = be.attention_saving();
        let total = Gpt2::activation_floats(cfg, b, t, saving);
        let mut carver = Carver {
            whole: Some(be.alloc(total)?),
            next: 0,
        };
        let (tokens, targets) = (be.alloc_tokens(b * t)?, be.alloc_tokens(b * t)?);
        let acts = Self::carve(&mut carver, cfg, b, t, saving, tokens, targets);
        debug_assert_eq!(carver.next, total);
        Ok(acts)
    }

    /// Activations for `b <= self.b` sequences in the same allocations: carved again, by the same code, from
    /// the start of the buffer that holds `self.b` sequences' worth.
    fn narrowed(&self, cfg: &ModelConfig, b: usize) -> Activations {
        if b == self.b {
            return self.clone();
        }
        let mut carver = Carver {
            whole: Some(self.whole),
            next: 0,
        };
        let bt = b * self.t;
        Self::carve(
            &mut carver,
            cfg,
            b,
            self.t,
            self.saving,
            self.tokens.sub(0, bt),
            self.targets.sub(0, bt),
        )
    }

    /// Frees the allocations behind every view of `self`.
    fn free<B: Backend>(self, be: &mut B) {
        be.free(self.whole);
        be.free_tokens(self.tokens);
        be.free_tokens(self.targets);
    }

    fn carve(
        a: &mut Carver,
        cfg: &ModelConfig,
        b: usize,
        t: usize,
        saving: AttentionSaving,
        tokens: TokenView,
        targets: TokenView,
    ) -> Self {
        let (c, nh, v) = (cfg.n_embd, cfg.n_head, cfg.vocab_size);
        let bt = b * t;
        let attention = AttentionShape { b, t, c, nh };
        let encoded = a.take(bt * c);
        let blocks = (0..cfg.n_layer)
            .map(|_| BlockActs {
                ln1: a.take(bt * c),
                ln1_mean: a.take(bt),
                ln1_rstd: a.take(bt),
                qkv: a.take(bt * 3 * c),
                att_saved: a.take(saving.saved_len(attention)),
                atty: a.take(bt * c),
                residual2: a.take(bt * c),
                ln2: a.take(bt * c),
                ln2_mean: a.take(bt),
                ln2_rstd: a.take(bt),
                fch: a.take(bt * 4 * c),
                fch_gelu: a.take(bt * 4 * c),
                residual3: a.take(bt * c),
            })
            .collect();
        Activations {
            b,
            t,
            whole: a.allocation(),
            tokens,
            targets,
            encoded,
            blocks,
            lnf: a.take(bt * c),
            lnf_mean: a.take(bt),
            lnf_rstd: a.take(bt),
            logits: a.take(bt * v),
            losses: a.take(bt),
            dres: a.take(bt * c),
            dbtc: a.take(bt * c),
            d4c_a: a.take(bt * 4 * c),
            d4c_b: a.take(bt * 4 * c),
            dqkv: a.take(bt * 3 * c),
            att_scratch: a.take(saving.scratch_len(attention)),
            saving,
        }
    }
}

/// A GPT-2 replica on one backend: flat parameters and gradients plus the activations of the last forward.
pub struct Gpt2 {
    pub config: ModelConfig,
    pub layout: ParamLayout,
    /// [layout.total]: every parameter, in layout order.
    pub params: View,
    /// [layout.total]: gradients, same layout; accumulated by backward until `zero_grads`.
    pub grads: View,
    /// Allocated for the largest micro-batch run so far at the current sequence length.
    acts: Option<Activations>,
    /// Sequences in the last forward's micro-batch: the first `rows` of `acts`.
    rows: usize,
    /// Set by [`Gpt2::forward_train`]: the logits already hold the head's gradient, for this `dloss`.
    head_gradient_for: Option<f32>,
}

impl Gpt2 {
    /// f32 elements of the activations (and backward scratch) of one `[b, t]` micro-batch: what the first
    /// forward allocates, counted by the same carving code. The two token buffers come on top.
    pub fn activation_floats(config: &ModelConfig, b: usize, t: usize, saving: AttentionSaving) -> usize {
        let mut counter = Carver { whole: None, next: 0 };
        let unallocated = TokenView {
            buf: usize::MAX,
            offset: 0,
            len: 0,
        };
        Activations::carve(&mut counter, config, b, t, saving, unallocated, unallocated);
        counter.next
    }

    /// Allocates parameters and gradients on the backend and uploads `init` (layout order).
    pub fn new<B: Backend>(be: &mut B, config: ModelConfig, init: &[f32]) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::new(&config);
        if init.len() != layout.total {
            bail!(
                "initial parameters have {} values, the model needs {}",
                init.len(),
                layout.total
            );
        }
        let params = be.alloc(layout.total)?;
        let grads = be.alloc(layout.total)?;
        be.upload(params, init)?;
        Ok(Gpt2 {
            config,
            layout,
            params,
            grads,
            acts: None,
            rows: 0,
            head_gradient_for: None,
        })
    }

    fn p(&self, offset: usize, len: usize) -> View {
        self.params.sub(offset, len)
    }

    fn g(&self, offset: usize, len: usize) -> View {
        self.grads.sub(offset, len)
    }

    /// Activations for a `[b, t]` batch: the first `b` sequences of those allocated, reused while the
    /// sequence length stays the same and `b` fits (micro-batches of uneven shares differ by one sequence),
    /// reallocated (the old ones freed) otherwise.
    fn ensure_acts<B: Backend>(&mut self, be: &mut B, b: usize, t: usize) -> Result<Activations> {
        if t == 0 || t > self.config.n_positions {
            bail!("sequence length {t} is outside 1..={}", self.config.n_positions);
        }
        if b == 0 {
            bail!("batch size must be at least 1");
        }
        match &self.acts {
            Some(a) if a.b >= b && a.t == t => {}
            _ => {
                // A new shape: the old activations' memory goes back before the new ones take theirs.
                if let Some(old) = self.acts.take() {
                    old.free(be);
                }
                self.acts = Some(Activations::new(be, &self.config, b, t)?);
            }
        }
        self.rows = b;
        Ok(self.current_acts().expect("activations were just allocated"))
    }

    /// The activations of the last forward's micro-batch.
    fn current_acts(&self) -> Option<Activations> {
        self.acts.as_ref().map(|a| a.narrowed(&self.config, self.rows))
    }

    /// Forward pass over `inputs [b, t]`, with per-position losses against `targets [b, t]`.
    /// Returns the mean loss of this batch (one small readback).
    pub fn forward<B: Backend>(
        &mut self,
        be: &mut B,
        inputs: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
    ) -> Result<f64> {
        self.forward_train(be, inputs, targets, b, t, None, &mut |_, _| Ok(()))
    }

    /// [`Gpt2::forward`] for training:
    /// - `needs(be, upto)` is called before the first op that reads the parameters `..upto` of the flat
    ///   layout (the embeddings, then each block in order, then the final layer norm and the tied head with
    ///   `upto` = everything). A sharded trainer waits there for the parameter all-gather of the buckets the
    ///   layer reads, so the gather of later layers overlaps the forward of earlier ones.
    /// - With `dloss`, the loss and the head's gradient come from one pass over the logits
    ///   (`crossentropy_forward_backward`): the logits are gone afterwards, and [`Gpt2::backward`] must be
    ///   called with the same `dloss`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_train<B: Backend>(
        &mut self,
        be: &mut B,
        inputs: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
        dloss: Option<f32>,
        needs: &mut dyn FnMut(&mut B, usize) -> Result<()>,
    ) -> Result<f64> {
        if inputs.len() != b * t || targets.len() != b * t {
            bail!(
                "batch of {} inputs / {} targets does not match b*t = {}",
                inputs.len(),
                targets.len(),
                b * t
            );
        }
        let v = self.config.vocab_size;
        if let Some(bad) = inputs.iter().chain(targets).find(|&&x| x as usize >= v) {
            bail!("token id {bad} is outside the model's vocabulary of {v}");
        }
        let acts = self.ensure_acts(be, b, t)?;
        be.upload_tokens(acts.tokens, inputs)?;
        be.upload_tokens(acts.targets, targets)?;
        self.forward_logits(be, &acts, needs)?;
        let n = b * t;
        let (losses, logits, targets, shape) = (acts.losses, acts.logits, acts.targets, LogitsShape { n, v });
        match dloss {
            Some(dloss) => be.crossentropy_forward_backward(
                CrossEntropyForwardBackward {
                    losses,
                    logits,
                    targets,
                    shape,
                    dloss,
                }
                .checked(),
            ),
            None => be.crossentropy_forward(
                CrossEntropyForward {
                    losses,
                    logits,
                    targets,
                    shape,
                }
                .checked(),
            ),
        }
        self.head_gradient_for = dloss;
        let mut losses = vec![0f32; n];
        be.download(acts.losses, &mut losses)?;
        Ok(losses.iter().map(|&x| x as f64).sum::<f64>() / n as f64)
    }

    /// Logits only, for sampling and evaluation: returns `[b, t, v]` on the host.
    pub fn logits<B: Backend>(&mut self, be: &mut B, inputs: &[u32], b: usize, t: usize) -> Result<Vec<f32>> {
        if inputs.len() != b * t {
            bail!("batch of {} inputs does not match b*t = {}", inputs.len(), b * t);
        }
        let v = self.config.vocab_size;
        if let Some(bad) = inputs.iter().find(|&&x| x as usize >= v) {
            bail!("token id {bad} is outside the model's vocabulary of {v}");
        }
        let acts = self.ensure_acts(be, b, t)?;
        be.upload_tokens(acts.tokens, inputs)?;
        self.forward_logits(be, &acts, &mut |_, _| Ok(()))?;
        let mut out = vec![0f32; b * t * v];
        be.download(acts.logits, &mut out)?;
        Ok(out)
    }

    fn forward_logits<B: Backend>(
        &self,
        be: &mut B,
        acts: &Activations,
        needs: &mut dyn FnMut(&mut B, usize) -> Result<()>,
    ) -> Result<()> {
        let cfg = &self.config;
        let (b, t, c, v) = (acts.b, acts.t, cfg.n_embd, cfg.vocab_size);
        let n = b * t;
        let lay = &self.layout;
        let wte = self.p(lay.wte, v * c);
        let wpe = self.p(lay.wpe, cfg.n_positions * c);
        // Where the parameters of block l end: the next block's start, or the final layer norm's.
        let block_end = |l: usize| lay.blocks.get(l + 1).map_or(lay.ln_f_w, |next| next.ln_1_w);
        needs(be, lay.blocks.first().map_or(lay.ln_f_w, |first| first.ln_1_w))?;
        be.encoder_forward(
            EncoderForward {
                out: acts.encoded,
                tokens: acts.tokens,
                wte,
                wpe,
                shape: EncoderShape { b, t, c },
            }
            .checked(),
        );
        let rows = RowsShape { n, c };
        let attn_shape = AttentionShape {
            b,
            t,
            c,
            nh: cfg.n_head,
        };
        let mut residual = acts.encoded;
        for (l, (bp, a)) in lay.blocks.iter().zip(&acts.blocks).enumerate() {
            needs(be, block_end(l))?;
            let w = self.block_views(bp, self.params);
            be.layernorm_forward(
                LayerNormForward {
                    out: a.ln1,
                    mean: a.ln1_mean,
                    rstd: a.ln1_rstd,
                    inp: residual,
                    weight: w.ln_1_w,
                    bias: w.ln_1_b,
                    shape: rows,
                }
                .checked(),
            );
            be.matmul_forward(linear(a.qkv, a.ln1, w.attn_w, w.attn_b, mm(n, c, 3 * c)));
            be.attention_forward(
                AttentionForward {
                    out: a.atty,
                    saved: a.att_saved,
                    qkv: a.qkv,
                    saving: acts.saving,
                    shape: attn_shape,
                }
                .checked(),
            );
            // residual2 = residual + c_proj(atty): project into residual2, then add the skip in place.
            be.matmul_forward(linear(a.residual2, a.atty, w.attn_proj_w, w.attn_proj_b, mm(n, c, c)));
            be.add_layernorm_forward(
                AddLayerNormForward {
                    residual: a.residual2,
                    skip: residual,
                    out: a.ln2,
                    mean: a.ln2_mean,
                    rstd: a.ln2_rstd,
                    weight: w.ln_2_w,
                    bias: w.ln_2_b,
                    shape: rows,
                }
                .checked(),
            );
            be.matmul_gelu_forward(
                MatmulGeluForward {
                    pre: a.fch,
                    out: a.fch_gelu,
                    inp: a.ln2,
                    weight: w.fc_w,
                    bias: w.fc_b,
                    shape: mm(n, c, 4 * c),
                }
                .checked(),
            );
            be.matmul_forward(linear(
                a.residual3,
                a.fch_gelu,
                w.fc_proj_w,
                w.fc_proj_b,
                mm(n, 4 * c, c),
            ));
            be.add_inplace(
                AddInplace {
                    dst: a.residual3,
                    src: a.residual2,
                }
                .checked(),
            );
            residual = a.residual3;
        }
        needs(be, lay.total)?;
        let (lnf_w, lnf_b) = (self.p(lay.ln_f_w, c), self.p(lay.ln_f_b, c));
        be.layernorm_forward(
            LayerNormForward {
                out: acts.lnf,
                mean: acts.lnf_mean,
                rstd: acts.lnf_rstd,
                inp: residual,
                weight: lnf_w,
                bias: lnf_b,
                shape: rows,
            }
            .checked(),
        );
        let head = MatmulShape {
            n,
            c,
            oc: v,
            layout: WeightLayout::OutIn,
        };
        be.matmul_forward(
            MatmulForward {
                out: acts.logits,
                inp: acts.lnf,
                weight: wte,
                bias: None,
                shape: head,
            }
            .checked(),
        );
        Ok(())
    }

    /// Backward pass of the last `forward`, accumulating into `grads`. `dloss` is the weight of each
    /// position's loss in the objective: `1 / (tokens in the global batch on this rank)`.
    pub fn backward<B: Backend>(&mut self, be: &mut B, dloss: f32) -> Result<()> {
        self.backward_reporting(be, dloss, &mut |_, _| Ok(()))
    }

    /// [`Gpt2::backward`], calling `finished(be, from)` each time the gradients of the flat elements
    /// `from..` are final: after the final layer norm, after each parameter op of each block (last block
    /// first; within a block the ops run from the layout's end to its start), and at the end with 0 (the
    /// token embedding `wte` is also the LM head, so it is final only after the embedding backward).
    /// The gradient sync starts communicating a bucket as soon as it is reported.
    pub fn backward_reporting<B: Backend>(
        &mut self,
        be: &mut B,
        dloss: f32,
        finished: &mut dyn FnMut(&mut B, usize) -> Result<()>,
    ) -> Result<()> {
        let Some(acts) = self.current_acts() else {
            bail!("backward called before forward")
        };
        let cfg = &self.config;
        let (b, t, c, v) = (acts.b, acts.t, cfg.n_embd, cfg.vocab_size);
        let n = b * t;
        match self.head_gradient_for.take() {
            None => be.crossentropy_backward(
                CrossEntropyBackward {
                    dlogits: acts.logits,
                    logits: acts.logits,
                    targets: acts.targets,
                    shape: LogitsShape { n, v },
                    dloss,
                }
                .checked(),
            ),
            Some(done) if done == dloss => {}
            Some(done) => {
                bail!("backward with dloss {dloss} after forward_train computed the head's gradient for {done}")
            }
        }
        let lay = &self.layout;
        let dlogits = acts.logits;
        let head = MatmulShape {
            n,
            c,
            oc: v,
            layout: WeightLayout::OutIn,
        };
        let (wte, dwte) = (self.p(lay.wte, v * c), self.g(lay.wte, v * c));
        be.matmul_backward(
            MatmulBackward {
                dinp: acts.dbtc,
                dweight: dwte,
                dbias: None,
                dout: dlogits,
                inp: acts.lnf,
                weight: wte,
                shape: head,
            }
            .checked(),
        );
        let rows = RowsShape { n, c };
        let last = acts.blocks.last().map_or(acts.encoded, |a| a.residual3);
        be.fill(acts.dres, 0.0);
        let (lnf_w, dlnf_w, dlnf_b) = (self.p(lay.ln_f_w, c), self.g(lay.ln_f_w, c), self.g(lay.ln_f_b, c));
        be.layernorm_backward(
            LayerNormBackward {
                dinp: acts.dres,
                dweight: dlnf_w,
                dbias: dlnf_b,
                dout: acts.dbtc,
                inp: last,
                weight: lnf_w,
                mean: acts.lnf_mean,
                rstd: acts.lnf_rstd,
                shape: rows,
            }
            .checked(),
        );
        finished(be, lay.ln_f_w)?;
        let attn_shape = AttentionShape {
            b,
            t,
            c,
            nh: cfg.n_head,
        };
        for (l, (bp, a)) in lay.blocks.iter().zip(&acts.blocks).enumerate().rev() {
            let residual = if l == 0 {
                acts.encoded
            } else {
                acts.blocks[l - 1].residual3
            };
            let w = self.block_views(bp, self.params);
            let dw = self.block_views(bp, self.grads);
            // dres holds d(residual3) = d(residual2 + fc_proj(gelu(fc(ln2(residual2))))).
            be.matmul_backward(linear_backward(
                acts.d4c_a,
                (dw.fc_proj_w, dw.fc_proj_b),
                acts.dres,
                a.fch_gelu,
                w.fc_proj_w,
                mm(n, 4 * c, c),
            ));
            finished(be, bp.fc_proj_w)?;
            be.gelu_backward(
                GeluBackward {
                    dinp: acts.d4c_b,
                    inp: a.fch,
                    dout: acts.d4c_a,
                }
                .checked(),
            );
            be.matmul_backward(linear_backward(
                acts.dbtc,
                (dw.fc_w, dw.fc_b),
                acts.d4c_b,
                a.ln2,
                w.fc_w,
                mm(n, c, 4 * c),
            ));
            finished(be, bp.fc_w)?;
            be.layernorm_backward(
                LayerNormBackward {
                    dinp: acts.dres,
                    dweight: dw.ln_2_w,
                    dbias: dw.ln_2_b,
                    dout: acts.dbtc,
                    inp: a.residual2,
                    weight: w.ln_2_w,
                    mean: a.ln2_mean,
                    rstd: a.ln2_rstd,
                    shape: rows,
                }
                .checked(),
            );
            finished(be, bp.ln_2_w)?;
            // dres now holds d(residual2) = d(residual + c_proj(attention(c_attn(ln1(residual))))).
            be.matmul_backward(linear_backward(
                acts.dbtc,
                (dw.attn_proj_w, dw.attn_proj_b),
                acts.dres,
                a.atty,
                w.attn_proj_w,
                mm(n, c, c),
            ));
            finished(be, bp.attn_proj_w)?;
            be.attention_backward(
                AttentionBackward {
                    dqkv: acts.dqkv,
                    scratch: acts.att_scratch,
                    dout: acts.dbtc,
                    qkv: a.qkv,
                    out: a.atty,
                    saved: a.att_saved,
                    saving: acts.saving,
                    shape: attn_shape,
                }
                .checked(),
            );
            be.matmul_backward(linear_backward(
                acts.dbtc,
                (dw.attn_w, dw.attn_b),
                acts.dqkv,
                a.ln1,
                w.attn_w,
                mm(n, c, 3 * c),
            ));
            finished(be, bp.attn_w)?;
            be.layernorm_backward(
                LayerNormBackward {
                    dinp: acts.dres,
                    dweight: dw.ln_1_w,
                    dbias: dw.ln_1_b,
                    dout: acts.dbtc,
                    inp: residual,
                    weight: w.ln_1_w,
                    mean: a.ln1_mean,
                    rstd: a.ln1_rstd,
                    shape: rows,
                }
                .checked(),
            );
            finished(be, bp.ln_1_w)?;
        }
        let (dwpe, wpe_len) = (lay.wpe, cfg.n_positions * c);
        be.encoder_backward(
            EncoderBackward {
                dwte,
                dwpe: self.g(dwpe, wpe_len),
                dout: acts.dres,
                tokens: acts.tokens,
                shape: EncoderShape { b, t, c },
            }
            .checked(),
        );
        finished(be, 0)
    }

    /// Per-position losses `[b*t]` of the last forward (tests read them at full precision).
    pub fn losses_view(&self) -> Option<View> {
        self.current_acts().map(|a| a.losses)
    }

    pub fn zero_grads<B: Backend>(&self, be: &mut B) {
        be.fill(self.grads, 0.0);
    }

    /// Views of one block's tensors inside `base` (the parameter or the gradient buffer).
    fn block_views(&self, bp: &BlockParams, base: View) -> BlockViews {
        let c = self.config.n_embd;
        let at = |offset: usize, len: usize| base.sub(offset, len);
        BlockViews {
            ln_1_w: at(bp.ln_1_w, c),
            ln_1_b: at(bp.ln_1_b, c),
            attn_w: at(bp.attn_w, c * 3 * c),
            attn_b: at(bp.attn_b, 3 * c),
            attn_proj_w: at(bp.attn_proj_w, c * c),
            attn_proj_b: at(bp.attn_proj_b, c),
            ln_2_w: at(bp.ln_2_w, c),
            ln_2_b: at(bp.ln_2_b, c),
            fc_w: at(bp.fc_w, c * 4 * c),
            fc_b: at(bp.fc_b, 4 * c),
            fc_proj_w: at(bp.fc_proj_w, 4 * c * c),
            fc_proj_b: at(bp.fc_proj_b, c),
        }
    }

    /// Downloads every parameter (layout order).
    pub fn download_params<B: Backend>(&self, be: &mut B) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.layout.total];
        be.download(self.params, &mut out)?;
        Ok(out)
    }

    /// Forward FLOPs per token (matmuls and attention), the usual 6N-style estimate's building block.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let cfg = &self.config;
        let (c, l, v) = (cfg.n_embd as f64, cfg.n_layer as f64, cfg.vocab_size as f64);
        let matmul = 2.0 * (l * (3.0 * c * c + c * c + 8.0 * c * c) + c * v);
        let attention = 2.0 * l * 2.0 * c * t as f64 / 2.0;
        matmul + attention
    }
}

/// The views of one block's twelve tensors.
struct BlockViews {
    ln_1_w: View,
    ln_1_b: View,
    attn_w: View,      // [c, 3c]
    attn_b: View,      // [3c]
    attn_proj_w: View, // [c, c]
    attn_proj_b: View, // [c]
    ln_2_w: View,
    ln_2_b: View,
    fc_w: View,      // [c, 4c]
    fc_b: View,      // [4c]
    fc_proj_w: View, // [4c, c]
    fc_proj_b: View, // [c]
}

fn mm(n: usize, c: usize, oc: usize) -> MatmulShape {
    MatmulShape {
        n,
        c,
        oc,
        layout: WeightLayout::InOut,
    }
}

/// A block's linear layer `out = inp @ weight + bias`, checked.
fn linear(out: View, inp: View, weight: View, bias: View, shape: MatmulShape) -> Checked<MatmulForward> {
    let bias = Some(bias);
    MatmulForward {
        out,
        inp,
        weight,
        bias,
        shape,
    }
    .checked()
}

/// The backward of [`linear`]: `dinp` overwritten, `(dweight, dbias)` accumulated, checked.
fn linear_backward(
    dinp: View,
    (dweight, dbias): (View, View),
    dout: View,
    inp: View,
    weight: View,
    shape: MatmulShape,
) -> Checked<MatmulBackward> {
    let dbias = Some(dbias);
    MatmulBackward {
        dinp,
        dweight,
        dbias,
        dout,
        inp,
        weight,
        shape,
    }
    .checked()
}
