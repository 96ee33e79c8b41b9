//! Pipelined decoding: the next step queued before the host reads this one's token, greedy
//! (`decode_greedy`) or drawn on the device (`decode_sampled`), and a step queued past a stop taken
//! back.

use super::*;

/// The device side of pipelined sampled decoding: the candidate blocks' survivors, the no-finite-
/// logit flag, and one uniform per position of the sequence (the draw of the step at position p
/// reads `uniforms[p]`, uploaded before the loop).
pub(super) struct SampleBuf {
    keys: DevBuf,
    flag: DevBuf,
    uniforms: DevBuf,
}
impl CudaSeq {
    /// Greedy decoding from `token` (fed at position `len()`): `max` decode steps at most, each
    /// committed, `on_token` given every step's argmax in order and returning whether to go on.
    /// Returns the steps committed. The same steps and ids as `step` in a loop, pipelined (graph
    /// and megakernel alike): each step leaves its argmax and the next position on the device
    /// (`kv_commit_step`), so the next step is queued before the host has read this one's token
    /// and the GPU does not wait for the host between tokens (25–43 µs a token on the H200,
    /// `gpu_check verifycost`). The megakernel's error flags are read once, at the end. When the host stops early, the step queued ahead is taken back:
    /// its position is not counted and its ring rows are restored (`kv_restore`).
    pub fn decode_greedy(&mut self, token: u32, max: usize, on_token: &mut dyn FnMut(u32) -> bool) -> Result<usize> {
        if self.len + max > self.max_len {
            bail!("position {} is past this sequence's maximum length {}", self.len + max - 1, self.max_len);
        }
        // Traced megakernel steps and sequences keeping hidden states (the drafter's: a step taken
        // back would leave its hidden state) step one token at a time.
        let traced = self.decode == Decode::Megakernel && self.trace_megakernel;
        if !self.pipeline || !self.use_graphs || traced || self.kv_layers == 0 || self.keep_hidden {
            let mut tok = token;
            for i in 0..max {
                tok = self.step(tok, false)?.argmax;
                if !on_token(tok) {
                    return Ok(i + 1);
                }
            }
            return Ok(max);
        }
        if max == 0 {
            return Ok(0);
        }
        self.start_steps(token)?;
        let tables = self.prepare_step_launches()?;
        self.pipelined(token, max, StepGraphs::Greedy(tables), on_token)
    }

    /// Before a pipelined loop from `token`: the token checked, nothing staged, scratch for
    /// single-token passes.
    fn start_steps(&mut self, token: u32) -> Result<()> {
        self.check_tokens(&[token])?;
        self.staged = 0;
        self.reserve(1)
    }

    /// Whether `decode_sampled` runs here with `params`: the device draw on (`device_draw`), the
    /// pipelined graph path, a top-k the device selection serves, and no hidden state to keep
    /// (a step queued ahead and taken back would leave it). Elsewhere sampled decoding steps one
    /// token at a time through the backend (`megagemma_model::backend::decode_sampled_steps`).
    pub fn draws_on_device(&self, params: &DrawParams) -> bool {
        self.device_draw
            && self.pipeline
            && self.use_graphs
            && self.decode == Decode::Graph
            && self.kv_layers > 0
            && !self.keep_hidden
            && candidates_on_device(self.model.plan.vocab_size, params.top_k)
    }

    /// Sampled decoding from `token` (fed at position `len()`) where `draws_on_device`: one
    /// committed step per uniform, step i's token drawn with `uniforms[i]` from its `params.top_k`
    /// highest logits, `on_token` given each token in order and returning whether to go on.
    /// Returns the steps committed. It is `decode_greedy`'s pipelined loop with the draw on the
    /// device (`sample_draw`: `megagemma_model::draw::draw_candidates`' arithmetic, operation for
    /// operation) before each step's commit, so the next step is queued before the host has the
    /// token: the tokens of `decode_sampled_steps`.
    pub fn decode_sampled(
        &mut self,
        token: u32,
        params: &DrawParams,
        uniforms: &[f64],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        check_draw(params)?;
        if !self.draws_on_device(params) {
            bail!("this sequence does not draw sampled tokens on the device (CudaSeq::draws_on_device)");
        }
        let max = uniforms.len();
        if self.len + max > self.max_len {
            bail!("position {} is past this sequence's maximum length {}", self.len + max - 1, self.max_len);
        }
        if max == 0 {
            return Ok(0);
        }
        self.start_steps(token)?;
        let len = self.len as u64;
        let buf = self.sample_buffers()?;
        let (uniforms_at, flag) = (buf.uniforms.ptr + len * 8, buf.flag.ptr);
        self.model.gpu.upload(uniforms_at, uniforms)?;
        self.model.gpu.upload(flag, &[0u32])?;
        if self.sample_graphs.as_ref().is_none_or(|(p, _)| p != params) {
            self.sample_graphs = None;
            self.commit_in_step = true;
            self.sample_stage = Some(*params);
            let captured = (|| -> Result<[CudaGraph; 2]> {
                let a = self.capture(|| self.run_step())?;
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                let b = self.capture(|| self.run_step());
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                Ok([a, b?])
            })();
            self.sample_stage = None;
            self.commit_in_step = false;
            self.sample_graphs = Some((*params, captured?));
        }
        let ran = self.pipelined(token, max, StepGraphs::Sampled, on_token)?;
        let mut set = [0u32];
        self.model.gpu.download(&mut set, flag)?;
        if set[0] != 0 {
            return Err(no_finite_logit());
        }
        Ok(ran)
    }

    /// The device's draw of a sampled step, after its pass (`sample_draw`: the candidate blocks'
    /// survivors of row 0 merged, then drawn with the uniform of the step's position).
    pub(super) fn draw_on_device(&self, params: &DrawParams) -> Result<()> {
        let buf = self.sample_buf.as_ref().ok_or_else(|| megagemma_model::Error::msg("sampling buffers missing"))?;
        let vocab = self.model.plan.vocab_size;
        debug_assert!(candidates_on_device(vocab, params.top_k), "draws_on_device checked the top-k");
        let at = DrawBuffers {
            keys: buf.keys.ptr,
            uniforms: buf.uniforms.ptr,
            meta: self.s.meta.ptr,
            ids: self.s.ids.ptr,
            flag: buf.flag.ptr,
        };
        launch_draw(self.gpu(), self.s.logits.ptr, vocab, params, &at)
    }

    /// `decode_sampled`'s device buffers, allocated on first use for the sequence's whole length.
    fn sample_buffers(&mut self) -> Result<&SampleBuf> {
        if self.sample_buf.is_none() {
            let gpu = &self.model.gpu;
            self.sample_buf = Some(SampleBuf {
                keys: gpu.alloc(survivors(self.model.plan.vocab_size, MAX_CANDIDATES) * 8)?,
                flag: gpu.alloc_zeros(4)?,
                uniforms: gpu.alloc_zeros(self.max_len.max(1) * 8)?,
            });
        }
        Ok(self.sample_buf.as_ref().expect("allocated above"))
    }

    /// The pipelined loop of `decode_greedy` and `decode_sampled` from `token` at position
    /// `len()`, up to `max` committed steps, launched as `graphs` says.
    fn pipelined(
        &mut self,
        token: u32,
        max: usize,
        graphs: StepGraphs,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        let tables = match graphs {
            StepGraphs::Greedy(t) => t,
            StepGraphs::Sampled => None,
        };
        self.model.gpu.upload(self.s.meta.ptr, &[self.len as u32, token])?;
        // Step i runs graph (or megakernel table) i % 2 (the second reads the meta the first
        // wrote, and the other way round); one step is queued ahead of the one waited for.
        let (mut queued, mut done) = (0, 0);
        let first = self.len;
        let ran = (|| -> Result<usize> {
            loop {
                while queued < max && queued <= done + 1 {
                    self.step_log.clear(first + queued);
                    self.launch_step(queued % 2, graphs)?;
                    queued += 1;
                }
                let id = self.wait_step_token(self.len)?;
                self.len += 1;
                done += 1;
                if !on_token(id) || done == max {
                    return Ok(done);
                }
            }
        })();
        if queued > done {
            // The step queued ahead committed its row at position len: put back the ring rows
            // it replaced (a full cache's row past len is unused).
            let args = [Arg::Ptr(self.kv_table.ptr), Arg::I32(self.len as i32)];
            self.gpu().launch("kv_restore", 2 * self.kv_layers as u32, 128, 0, &args)?;
        }
        self.model.gpu.sync()?;
        if let Some(tables) = tables {
            // A wait that timed out is the error to report (it also explains a missing token).
            for i in tables {
                self.check_megakernel(i)?;
            }
            self.mk_last = tables[0];
        }
        ran
    }

    /// The two launches of the pipelined loop: the committed decode step (`decode_graph[1]`, or
    /// its megakernel table) and the same with its meta buffers swapped (`ahead_graph`, or the
    /// `ahead` table); the tables' indices on the megakernel path.
    fn prepare_step_launches(&mut self) -> Result<Option<[usize; 2]>> {
        self.commit_in_step = true;
        let prepared = (|| {
            if self.decode == Decode::Megakernel {
                let pass = |ahead| MkPass { tokens: 1, first: 0, commit: true, ahead, batched: false };
                return Ok(Some([self.megakernel_table(pass(false))?, self.megakernel_table(pass(true))?]));
            }
            if self.decode_graph[1].is_none() {
                self.decode_graph[1] = Some(self.capture(|| self.run_step())?);
            }
            if self.ahead_graph.is_none() {
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                let g = self.capture(|| self.run_step());
                std::mem::swap(&mut self.s.meta, &mut self.s.meta_next);
                self.ahead_graph = Some(g?);
            }
            Ok(None)
        })();
        self.commit_in_step = false;
        prepared
    }

    /// Queues pipelined step `which` of `graphs`: greedy, `decode_graph[1]` (0) or `ahead_graph`
    /// (1), on the megakernel path the launch of table `tables[which]`; sampled, `sample_graphs`'
    /// graph `which`.
    fn launch_step(&mut self, which: usize, graphs: StepGraphs) -> Result<()> {
        let g = match graphs {
            StepGraphs::Greedy(Some(t)) => return self.megakernels[t[which]].1.launch(&self.model.gpu, 0),
            StepGraphs::Greedy(None) => if which == 0 { &self.decode_graph[1] } else { &self.ahead_graph }.as_ref(),
            StepGraphs::Sampled => self.sample_graphs.as_ref().map(|(_, g)| &g[which]),
        };
        let g = g.ok_or_else(|| megagemma_model::Error::msg("pipelined step graph not captured"))?;
        self.model.gpu.count_launch();
        g.launch().map_err(|e| cuda_err("graph launch", e))
    }

    /// The argmax of the queued decode step at position `pos`, once its tagged slot of the step
    /// log arrives (polled: no event between the steps' graphs). A step that failed, or a stream
    /// that went idle without the slot, is an error.
    fn wait_step_token(&self, pos: usize) -> Result<u32> {
        let tag = pos as u64 + 1;
        let mut spins = 0u32;
        loop {
            let v = self.step_log.read(pos);
            if v >> 32 == tag {
                return Ok(v as u32);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && self.model.gpu.stream_done()? {
                let v = self.step_log.read(pos);
                if v >> 32 == tag {
                    return Ok(v as u32);
                }
                bail!("the decode step at position {pos} finished without handing its token over");
            }
            std::hint::spin_loop();
        }
    }
}
