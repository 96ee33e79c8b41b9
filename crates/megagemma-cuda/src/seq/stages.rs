//! The forward pass as launches, stage by stage: the matvecs (tensor-core, CUDA-core, with a
//! residual step folded in or its inputs prepared), norms, attention, the feed-forward and MoE,
//! recorded in order by `run` for one pass of `t` tokens.

use super::*;

impl CudaSeq {
    pub(crate) fn gpu(&self) -> &Gpu {
        &self.model.gpu
    }

    pub(crate) fn cache(&self, layer: usize) -> Option<&LayerCache> {
        self.caches.get(layer).and_then(Option::as_ref)
    }

    pub(crate) fn scratch(&self) -> &Scratch {
        &self.s
    }

    /// `y[t] = W·x[t]` for `t` columns, in launches of up to eight columns (each column's
    /// arithmetic is independent of the others, so the split does not change any bit).
    pub(crate) fn matvec(&self, w: &DevMat, x: u64, y: u64, t: usize) -> Result<()> {
        self.matvec_impl(w, x, None, y, t)
    }

    /// `y[t] = W·(gelu(x[t]) · gate[t])`: fused into the 4-bit kernel, else a separate pass over `x`.
    pub(crate) fn matvec_gated(&self, w: &DevMat, x: u64, gate: Gate, y: u64, t: usize) -> Result<()> {
        self.matvec_impl(w, x, Some(gate), y, t)
    }

    /// Whether `w` takes the 4-bit many-rows-per-warp kernel (16-aligned rows).
    fn q4_fast(w: &DevMat) -> bool {
        w.fmt == FMT_Q4 && (w.cols as usize).is_multiple_of(16)
    }

    /// Warps sharing a row group: each warp takes its 512-column chunks in order and should
    /// get at least two, unless that leaves SMs idle (few rows): then up to one chunk per warp.
    /// Depends only on the shape (and the GPU), never on the number of columns of x.
    fn warps_per_rows(&self, rows: usize, cols: usize) -> usize {
        let chunks = cols.div_ceil(512);
        let mut wpr = [8, 4, 2, 1].into_iter().find(|&w| 2 * w <= chunks).unwrap_or(1);
        while wpr < 8 && 2 * wpr <= chunks && rows.div_ceil(8 * (8 / wpr)) < self.gpu().sms as usize {
            wpr *= 2;
        }
        wpr
    }

    /// Blocks launched for `nblocks` virtual blocks of the 4-bit kernels: at most
    /// `blocks_per_sm` per SM, each looping over its share.
    fn q4_grid(&self, nblocks: usize) -> u32 {
        nblocks.min(self.gpu().q4_stream.blocks_per_sm * self.gpu().sms as usize) as u32
    }

    /// How the tensor-core kernel splits a launch (`mma_split`), or `MEGAGEMMA_CUDA_MMA_SPLITS`'s
    /// split for the shape when it names one the kernel can run.
    fn mma_split(&self, tiles: &[usize], cols: usize, gated: bool) -> MmaSplit {
        let q = &self.gpu().q4_stream;
        let round = q.mma_waves * q.mma_blocks_per_sm * self.gpu().sms as usize;
        if let Some(split) = split_override(tiles[0] * 16, cols) {
            if split_runs(tiles, cols, split) {
                return split;
            }
        }
        mma_split(tiles, cols, gated, round, q.mma_part_chunks, q.mma_fill)
    }

    /// Tensor-core 4-bit matvecs (`kernels/matvec_mma.cu`) of up to three tiled matrices of the
    /// same width and group class on the same input, or one gated matrix: launches of ≤ 8 columns.
    /// With `res` (plain launches only), the pending residual step of rows `row0 ..` is folded into
    /// the input (`x` unused): each launch's block 0 writes the new residual to the other buffer.
    /// With `sums` (one split launch of ≤ 8 columns: `matvec_sum`), the column parts are added
    /// into `y0` as 64-bit sums, and the launch clears the sum buffer `sums` for the next one.
    #[allow(clippy::too_many_arguments)]
    fn matvec_mma(
        &self,
        mats: &[(&DevMat, u64)],
        x: u64,
        gate: Option<Gate>,
        t: usize,
        res: Option<(PendingNorm, usize)>,
        prep: bool,
        sums: Option<u64>,
    ) -> Result<()> {
        let (w0, y0) = mats[0];
        let cols = w0.cols as usize;
        let tiles: Vec<usize> = mats.iter().map(|(w, _)| (w.rows as usize).div_ceil(16)).collect();
        let split = self.mma_split(&tiles, cols, gate.is_some());
        let nb: Vec<usize> = tiles.iter().map(|&t| split.matrix_blocks(t)).collect();
        let nblocks: usize = nb.iter().sum();
        let grid = nblocks.min(self.gpu().q4_stream.mma_blocks_per_sm * self.gpu().sms as usize) as u32;
        // L2 requests for the next virtual block (`MEGAGEMMA_CUDA_MMA_AHEAD`, default none) only
        // in passes of several tokens, and only while a launch runs at most two rounds of virtual
        // blocks. Single-token passes load their first weights into registers before the wait,
        // and without the requests they are faster (fourteenth session: megakernel E4B -4%, E2B
        // -2.6%, graph E2B -0.7%, E4B +-0); since the twenty-fourth session passes of several
        // tokens go without them too (verify 2-4% faster, `Q4Stream::mma_ahead`). The LM head's
        // 2,048 virtual blocks (E4B) asked a round ahead are ~54 MB, more than L2 holds, and
        // evicted lines were read twice (Nsight Compute: 561 MB read for its 419, 155 µs; with
        // none 419 MB, 119 µs).
        let ahead = if t == 1 || nblocks > 2 * grid as usize { 0 } else { self.gpu().q4_stream.mma_ahead as i32 };
        let chunks = cols.div_ceil(64);
        let upc = if w0.gs == 32 { 2 } else { 1 };
        // 64-bit sums (FIXED_SUMS): no counters, and the partial sums' pointer names the buffer to clear.
        let (partial, counters) = match sums {
            Some(clear) => (Arg::Ptr(clear), Arg::Ptr(0)),
            None => (Arg::Ptr(self.s.mma_partial.ptr), Arg::Ptr(self.s.mma_counters.ptr)),
        };
        for c0 in (0..t).step_by(MATVEC_COLS) {
            let m = MATVEC_COLS.min(t - c0);
            let h = m.div_ceil(4);
            // Input fragments and per-unit sums per 64-column chunk.
            let slice = chunks.min(MMA_SLICE_BYTES / mma_chunk_bytes(h, upc));
            // The ring form is for launched passes only: a megakernel's stage table records the
            // register form's names (it inlines the ring itself).
            let ring = self.gpu().q4_stream.mma_ring && h == 1 && !self.gpu().is_recording() && !prep;
            let ring_bytes = if ring { mma_ring_bytes(upc as u32) } else { 0 };
            let smem = (slice * mma_chunk_bytes(h, upc)) as u32 + ring_bytes;
            // Single-token launches run the entries built for one token (not recorded into a
            // megakernel's stage table, which dispatches the four-token names).
            let one = self.gpu().q4_stream.mma_one && m == 1 && !ring && !prep && !self.gpu().is_recording();
            let name = match (prep, one) {
                (true, _) => mma_prep_kernels(h, upc == 2).1,
                (false, true) => mma_one_kernel(upc == 2, gate.is_some()),
                (false, false) => mma_kernel(h, upc == 2, gate.is_some(), ring),
            };
            let yp = |y: u64, w: &DevMat| if y == 0 { 0 } else { y + f32s(c0 * w.rows as usize) as u64 };
            let xp = x + f32s(c0 * cols) as u64;
            // Both entry points take (columns, warps per tile, column parts, virtual blocks, blocks
            // ahead, partial sums, counters) after their matrices and pointers; the gated one then
            // takes the gate.
            let split = [
                Arg::I32(m as i32),
                Arg::I32(split.arg()),
                Arg::I32(split.parts as i32),
                Arg::I32(nblocks as i32),
                Arg::I32(ahead),
                partial,
                counters,
            ];
            match gate {
                Some(g) => {
                    let gate = [Arg::Ptr(g.ptr + f32s(c0 * g.stride) as u64), Arg::I32(g.stride as i32)];
                    let head: [Arg; 10] = join([Arg::Mat(*w0), Arg::Ptr(xp), Arg::Ptr(yp(y0, w0))], split);
                    let args: [Arg; 12] = join(head, gate);
                    self.gpu().launch(name, grid, 256, smem, &args)?;
                }
                None => {
                    let (w1, y1) = mats.get(1).copied().unwrap_or((w0, 0));
                    let (w2, y2) = mats.get(2).copied().unwrap_or((w0, 0));
                    let head = [
                        Arg::Mat(*w0),
                        Arg::Mat(*w1),
                        Arg::Mat(*w2),
                        Arg::Ptr(xp),
                        Arg::Ptr(yp(y0, w0)),
                        Arg::Ptr(yp(y1, w1)),
                        Arg::Ptr(yp(y2, w2)),
                        Arg::I32(nb[0] as i32),
                        Arg::I32(nb.get(1).copied().unwrap_or(0) as i32),
                    ];
                    let args: [Arg; 16] = join(head, split);
                    if prep {
                        // `x` is the prepared inputs of the whole pass (one launch: t ≤ 8).
                        self.gpu().launch(name, grid, 256, smem, &args)?;
                    } else {
                        let args: [Arg; 23] = join(args, self.residual_args(res, c0, cols));
                        self.gpu().launch(name, grid, 256, smem, &args)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `y = W·x`, or `W·(gelu(x) · gate)`, whose only reader is a residual step (its `o`); returns
    /// where the step reads it: `y`, or (`Gpu::fixed_sums`, the default) for a
    /// split tensor-core launch, the pass's next 64-bit sum buffer, tagged with bit 0 (`ld4_sum` in
    /// kernels/common.cuh). The launches that write sums alternate between the two buffers, each
    /// clearing the other (whose reader has finished); a pass starts with the first one clear and,
    /// with an even count of them (`sums_in_pass`: its first runs in part order when the count is
    /// odd), ends so too.
    fn matvec_sum(&self, w: &DevMat, x: u64, gate: Option<Gate>, y: u64, t: usize) -> Result<u64> {
        if self.sums_fixed(w, gate, t) && !self.sums_skip_first.replace(false) {
            let n = self.sums_next.get();
            self.sums_next.set(n + 1);
            let half = (MATVEC_COLS * self.model.plan.hidden * 8) as u64;
            let (sums, clear) =
                (self.s.sums.ptr + (n % 2) as u64 * half, self.s.sums.ptr + ((n + 1) % 2) as u64 * half);
            self.matvec_tiled(w, x, gate, sums, t, Some(clear))?;
            return Ok(sums | 1);
        }
        self.matvec_impl(w, x, gate, y, t)?;
        Ok(y)
    }

    /// A tiled matrix's product on the tensor cores, the gate applied by the kernel when its rows
    /// allow (else a GeGLU pass first); `sums` as in `matvec_mma`.
    fn matvec_tiled(&self, w: &DevMat, x: u64, gate: Option<Gate>, y: u64, t: usize, sums: Option<u64>) -> Result<()> {
        match gate {
            Some(g) if !g.stride.is_multiple_of(4) => {
                self.gelu_gate_in_place(x, g, w.cols as usize, t)?;
                self.matvec_mma(&[(w, y)], x, None, t, None, false, sums)
            }
            _ => self.matvec_mma(&[(w, y)], x, gate, t, None, false, sums),
        }
    }

    /// Whether `matvec_sum` adds this launch's parts as 64-bit sums: `ORDERED_SUMS` is off, the
    /// matrix is tiled and hidden-wide, and its one launch (≤ 8 columns, not a long pass) is split.
    fn sums_fixed(&self, w: &DevMat, gate: Option<Gate>, t: usize) -> bool {
        let gated = gate.is_some_and(|g| g.stride.is_multiple_of(4));
        self.gpu().fixed_sums
            && w.fmt == FMT_Q4T
            && t <= MATVEC_COLS
            && !self.long_pass(t)
            && w.rows as usize == self.model.plan.hidden
            && self.mma_split(&[(w.rows as usize).div_ceil(16)], w.cols as usize, gated).parts > 1
    }

    /// How many of a pass's launches `sums_fixed` takes (the order `layer` runs them in).
    fn sums_in_pass(&self, t: usize) -> usize {
        let m = &*self.model;
        let lpw = m.plan.layers.len() * m.plan.ple_dim;
        let w = m.weights();
        let fixed =
            |w: &DevMat, stride: Option<usize>| self.sums_fixed(w, stride.map(|stride| Gate { ptr: 0, stride }), t);
        w.layers
            .iter()
            .map(|lw| {
                let o = fixed(&lw.o, None);
                let down = lw.moe.is_none() && fixed(&lw.down, Some(lw.gate.rows as usize));
                let ple = lw.ple.as_ref().is_some_and(|ple| fixed(&ple.proj, Some(lpw)));
                [o, down, ple].into_iter().filter(|&f| f).count()
            })
            .sum()
    }

    /// `x[t][i] = gelu(x[t][i]) · gate[t][i]` over `t` rows of `cols` (the GeGLU), in place: before
    /// a matvec whose kernel cannot apply the gate itself, and for the MoE experts.
    fn gelu_gate_in_place(&self, x: u64, g: Gate, cols: usize, t: usize) -> Result<()> {
        let args = [Arg::Ptr(x), Arg::Ptr(g.ptr), Arg::I32(cols as i32), Arg::I32(g.stride as i32), Arg::I32(t as i32)];
        self.elementwise("gelu_gate", t * cols, &args)
    }

    /// Whether these matrices (same input) take one tensor-core matvec launch per eight columns.
    fn one_mma_launch(&self, mats: &[(&DevMat, u64)]) -> bool {
        let (cols, g32) = (mats[0].0.cols, mats[0].0.gs == 32);
        let one_part = (cols as usize).div_ceil(64) <= self.gpu().q4_stream.mma_part_chunks;
        mats.len() <= 3
            && (mats.len() == 1 || one_part)
            && mats.iter().all(|(w, _)| w.fmt == FMT_Q4T && w.cols == cols && (w.gs == 32) == g32)
    }

    /// The residual stream's buffer at this point of the pass being launched.
    fn xcur(&self) -> u64 {
        if self.x_in_x2.get() {
            self.s.x2.ptr
        } else {
            self.s.x.ptr
        }
    }

    /// The residual buffer a step that does not write in place writes (the one `xcur` is not).
    fn xother(&self) -> u64 {
        if self.x_in_x2.get() {
            self.s.x.ptr
        } else {
            self.s.x2.ptr
        }
    }

    /// The plain tensor-core entry points' trailing `Residual` arguments for the launch of columns
    /// `c0 ..` (all zero without one).
    fn residual_args(&self, res: Option<(PendingNorm, usize)>, c0: usize, cols: usize) -> [Arg; 7] {
        let eps = self.model.plan.eps;
        let Some((p, row0)) = res else {
            return [Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::F32(1.0), Arg::F32(eps)];
        };
        // The folded step reads the current residual buffer and writes the other.
        let (xin, xout) = (self.xcur(), self.xother());
        let at = f32s((row0 + c0) * cols) as u64;
        // `o` tagged with bit 0 holds 64-bit sums (`matvec_sum`): rows of 8-byte elements.
        let o = if p.o & 1 == 1 { p.o + 2 * at } else { p.o + at };
        [
            Arg::Ptr(xin + at),
            Arg::Ptr(o),
            Arg::Ptr(p.w1),
            Arg::Ptr(p.w2),
            Arg::Ptr(xout + at),
            Arg::F32(p.scale),
            Arg::F32(eps),
        ]
    }

    /// `y_i = W_i·x` (as `matvec_many`) after the pending residual step, if any: folded into the
    /// matvec in single-token passes when it is one tensor-core launch on hidden-wide rows (`x` is then the step's output
    /// by construction: its norm, or the new residual), else run first with `add_norm`. `row0`: the
    /// first row of the step the matvec reads (the LM head reads the wanted positions only).
    fn matvec_after(
        &self,
        mats: &[(&DevMat, u64)],
        x: u64,
        pending: Option<PendingNorm>,
        row0: usize,
        t: usize,
    ) -> Result<()> {
        let Some(p) = pending else { return self.matvec_many(mats, x, t) };
        let h = self.model.plan.hidden;
        // Single-token passes only: the folded step computes each token's row statistics in turn,
        // so a verify or short prefill pass of t tokens would pay t times its latency in every
        // block (measured: a 4-column verify 1.27x -> 1.49x a decode step). All tokens' statistics
        // in one pass over their rows was no better (twenty-third session: 3-column verify +16%,
        // and the code it adds made E4B decode 7.7% slower): every block then rebuilds each
        // token's inputs from x, o and both norm weights, where `add_norm` writes them once.
        if self.fold_norms && t == 1 && self.one_mma_launch(mats) && mats[0].0.cols as usize == h {
            self.matvec_mma(mats, 0, None, t, Some((p, row0)), false, None)?;
            self.x_in_x2.set(!self.x_in_x2.get());
            return Ok(());
        }
        // Three to eight tokens (one launch of each): the step prepares the inputs once, one block
        // per token, and the matvec copies them instead of building them in each of its blocks.
        let prep = self.prep_inputs
            && row0 == 0
            && (self.prep_min..=MATVEC_COLS).contains(&t)
            && !self.long_pass(t)
            && !self.gpu().is_recording()
            && self.one_mma_launch(mats)
            && mats[0].0.cols as usize == h;
        if prep {
            let (step, _) = mma_prep_kernels(t.div_ceil(4), mats[0].0.gs == 32);
            // Each token's row in slices of whole chunks, a block each: every block takes the
            // row's statistics, and writes and prepares its slice only (one block per token built
            // the whole row after its reductions, on the critical path of every residual step).
            self.add_norm(p, t, self.norm_slices(), Some((step, self.s.mma_prep.ptr)))?;
            return self.matvec_mma(mats, self.s.mma_prep.ptr, None, t, None, true, None);
        }
        // Otherwise the step runs first and the matvecs build their inputs from its output. Before
        // one hidden-wide tensor-core launch (the megakernel's passes of several tokens, whose
        // tables take no prepared-input entries) it runs in slices too, so no block writes a whole
        // row after its reductions.
        let sliced = row0 == 0 && !self.long_pass(t) && self.one_mma_launch(mats) && mats[0].0.cols as usize == h;
        self.add_norm(p, row0 + t, if sliced { self.norm_slices() } else { 1 }, None)?;
        // Without w2 the matvec's input is the new residual, which a sliced step wrote elsewhere.
        let x = if p.w2 == 0 { self.xcur() } else { x };
        self.matvec_many(mats, x, t)
    }

    /// Blocks per token of a sliced residual step: whole 64-column chunks each, about
    /// `MEGAGEMMA_CUDA_PREP_SLICES` of them (default 8; 1: the step in place, one block a token).
    fn norm_slices(&self) -> usize {
        let chunks = self.model.plan.hidden.div_ceil(64);
        chunks.div_ceil(chunks.div_ceil(self.prep_slices))
    }

    /// `y_i[t] = W_i·x[t]` for up to three matrices of the same width (Q/K/V, gate/up): one launch
    /// per eight columns when all are 4-bit in the same layout, else one matvec each.
    pub(crate) fn matvec_many(&self, mats: &[(&DevMat, u64)], x: u64, t: usize) -> Result<()> {
        if self.long_pass(t) && self.gemm(mats, x, None, t)? {
            return Ok(());
        }
        let cols = mats[0].0.cols;
        if self.one_mma_launch(mats) {
            return self.matvec_mma(mats, x, None, t, None, false, None);
        }
        if mats.len() > 1 && mats.iter().any(|(w, _)| w.fmt == FMT_Q4T) {
            return mats.iter().try_for_each(|(w, y)| self.matvec_impl(w, x, None, *y, t));
        }
        if mats.len() > 3 || !mats.iter().all(|(w, _)| Self::q4_fast(w) && w.cols == cols) {
            return mats.iter().try_for_each(|(w, y)| self.matvec_impl(w, x, None, *y, t));
        }
        let cols = cols as usize;
        let wpr = self.warps_per_rows(mats.iter().map(|(w, _)| w.rows as usize).sum(), cols);
        let blocks = |w: &DevMat| (w.rows as usize).div_ceil(8 * (8 / wpr));
        let (w0, y0) = mats[0];
        let (w1, y1) = mats.get(1).copied().unwrap_or((w0, 0));
        let (w2, y2) = mats.get(2).copied().unwrap_or((w0, 0));
        let nb0 = blocks(w0);
        let nb1 = if mats.len() > 1 { blocks(w1) } else { 0 };
        let nb2 = if mats.len() > 2 { blocks(w2) } else { 0 };
        let nblocks = nb0 + nb1 + nb2;
        for c0 in (0..t).step_by(MATVEC_COLS) {
            let m = MATVEC_COLS.min(t - c0);
            let yp = |y: u64, w: &DevMat| if y == 0 { 0 } else { y + f32s(c0 * w.rows as usize) as u64 };
            let args = [
                Arg::Mat(*w0),
                Arg::Mat(*w1),
                Arg::Mat(*w2),
                Arg::Ptr(x + f32s(c0 * cols) as u64),
                Arg::Ptr(yp(y0, w0)),
                Arg::Ptr(yp(y1, w1)),
                Arg::Ptr(yp(y2, w2)),
                Arg::I32(nb0 as i32),
                Arg::I32(nb1 as i32),
                Arg::I32(m as i32),
                Arg::I32(wpr as i32),
                Arg::I32(nblocks as i32),
                Arg::I32(self.gpu().q4_stream.ahead as i32),
            ];
            self.gpu().launch("matvec_q4", self.q4_grid(nblocks), 256, 0, &args)?;
        }
        Ok(())
    }

    fn matvec_impl(&self, w: &DevMat, x: u64, gate: Option<Gate>, y: u64, t: usize) -> Result<()> {
        if self.long_pass(t) && self.gemm(&[(w, y)], x, gate.map(|g| (g.ptr, g.stride)), t)? {
            return Ok(());
        }
        let (rows, cols) = (w.rows as usize, w.cols as usize);
        if w.fmt == FMT_Q4T {
            return self.matvec_tiled(w, x, gate, y, t, None);
        }
        let q4_fast = Self::q4_fast(w) && gate.is_none_or(|g| g.stride.is_multiple_of(4));
        match (gate, q4_fast) {
            (None, true) => return self.matvec_many(&[(w, y)], x, t),
            (Some(g), false) => self.gelu_gate_in_place(x, g, cols, t)?,
            _ => {}
        }
        let wpr = self.warps_per_rows(rows, cols);
        let nblocks = rows.div_ceil(8 * (8 / wpr));
        for c0 in (0..t).step_by(MATVEC_COLS) {
            let m = MATVEC_COLS.min(t - c0);
            let (xp, yp) = (x + f32s(c0 * cols) as u64, y + f32s(c0 * rows) as u64);
            match gate {
                Some(g) if q4_fast => {
                    let args = [
                        Arg::Mat(*w),
                        Arg::Ptr(xp),
                        Arg::Ptr(yp),
                        Arg::I32(m as i32),
                        Arg::I32(wpr as i32),
                        Arg::Ptr(g.ptr + f32s(c0 * g.stride) as u64),
                        Arg::I32(g.stride as i32),
                        Arg::I32(nblocks as i32),
                        Arg::I32(self.gpu().q4_stream.ahead as i32),
                    ];
                    self.gpu().launch("matvec_q4_gated", self.q4_grid(nblocks), 256, 0, &args)?;
                }
                _ => {
                    let grid = rows.div_ceil(MATVEC_ROWS_PER_BLOCK) as u32;
                    let args = [Arg::Mat(*w), Arg::Ptr(xp), Arg::Ptr(yp), Arg::I32(m as i32)];
                    self.gpu().launch("matvec", grid, (MATVEC_ROWS_PER_BLOCK * 32) as u32, 0, &args)?;
                }
            }
        }
        Ok(())
    }

    /// RMSNorm of `chunks` chunks of `dim`: `y = x̂·w` (add: `y += x̂·w`); `w = 0` for no weight.
    fn norm(&self, y: u64, x: u64, w: u64, dim: usize, chunks: usize, add: bool) -> Result<()> {
        let block = 256;
        let eps = self.model.plan.eps;
        let args = [Arg::Ptr(y), Arg::Ptr(x), Arg::Ptr(w), Arg::I32(dim as i32), Arg::F32(eps), Arg::I32(add as i32)];
        self.gpu().launch("rms_norm", chunks as u32, block, 0, &args)
    }

    pub(crate) fn elementwise(&self, name: &str, n: usize, args: &[Arg]) -> Result<()> {
        self.gpu().launch(name, n.div_ceil(256) as u32, 256, 0, args)
    }

    /// The whole pass over `t` staged tokens; logits and argmax of positions `first .. t` land in
    /// rows `0 .. t − first` of `s.logits` / `s.ids`.
    pub(super) fn run(&self, t: usize, first: usize) -> Result<()> {
        let m = &*self.model;
        let (plan, w, s) = (&m.plan, m.weights(), &self.s);
        let h = plan.hidden;
        self.x_in_x2.set(false);
        self.sums_next.set(0);
        let sum_launches = if self.gpu().fixed_sums { self.sums_in_pass(t) } else { 0 };
        self.sums_skip_first.set(sum_launches % 2 == 1);

        // §2.1 embedding · sqrt(H).
        let args = [Arg::Mat(w.embed), Arg::Ptr(s.meta.at(4)), Arg::Ptr(s.x.ptr), Arg::F32(plan.embed_scale)];
        self.gpu().launch("embed_gather", gather_blocks(t, h), GATHER_THREADS, 0, &args)?;

        // §2.2 per-layer inputs [T, L·P].
        if let Some(ple) = &w.ple {
            let (p, lpw) = (plan.ple_dim, plan.layers.len() * plan.ple_dim);
            self.matvec(&ple.proj, s.x.ptr, s.pli.ptr, t)?;
            let proj_scale = (h as f64).powf(-0.5) as f32;
            self.elementwise(
                "scale",
                t * lpw,
                &[Arg::Ptr(s.pli.ptr), Arg::F32(proj_scale), Arg::U64((t * lpw) as u64)],
            )?;
            self.norm(s.pli.ptr, s.pli.ptr, ple.norm, p, t * plan.layers.len(), false)?;
            let embed_scale = (p as f64).sqrt() as f32;
            let input_scale = std::f64::consts::FRAC_1_SQRT_2 as f32;
            let args = [
                Arg::Ptr(s.pli.ptr),
                Arg::Mat(ple.table),
                Arg::Ptr(s.meta.at(4)),
                Arg::F32(embed_scale),
                Arg::F32(input_scale),
            ];
            self.gpu().launch("ple_combine", gather_blocks(t, lpw), GATHER_THREADS, 0, &args)?;
        }

        // Each layer starts with `a` = its input norm of `x` (or that step pending) and ends with
        // the residual step whose norm is the next layer's (or the final) input, pending.
        self.norm(s.a.ptr, s.x.ptr, w.layers[0].input_norm, h, t, false)?;
        let mut pending = None;
        for (i, (lp, lw)) in plan.layers.iter().zip(&w.layers).enumerate() {
            let next_norm = w.layers.get(i + 1).map_or(w.final_norm, |l| l.input_norm);
            pending = Some(self.layer(lp, lw, next_norm, t, pending)?);
        }

        // §2.4 LM head on the final-normed wanted positions, softcap, argmax.
        let n = t - first;
        self.matvec_after(&[(&w.lm_head, s.logits.ptr)], s.a.at(f32s(first * h)), pending, first, n)?;
        let cap = plan.final_softcap.unwrap_or(0.0);
        let v = plan.vocab_size as i32;
        let args = [
            Arg::Ptr(s.logits.ptr),
            Arg::I32(v),
            Arg::F32(cap),
            Arg::Ptr(s.partial.ptr),
            Arg::I32(ARGMAX_SPLIT as i32),
        ];
        self.gpu().launch("softcap_argmax_partial", (n * ARGMAX_SPLIT) as u32, 256, 0, &args)?;
        let args = [Arg::Ptr(s.partial.ptr), Arg::I32(ARGMAX_SPLIT as i32), Arg::Ptr(s.ids.ptr)];
        self.gpu().launch("argmax_final", n as u32, 32, 0, &args)?;
        if self.keep_hidden {
            // The final residual of the wanted positions (the step the LM head folded or ran
            // wrote it to `xcur`), normed again for the drafter.
            self.norm(s.hid.ptr, self.xcur() + f32s(first * h) as u64, w.final_norm, h, n, false)?;
        }
        // `sums_in_pass` restates which launches `layer` sends through `matvec_sum`; if the two
        // disagreed, the next pass would add into a sum buffer left written. Caught here, on every
        // pass, rather than as wrong logits later.
        let ran = self.sums_next.get() + usize::from(sum_launches % 2 == 1 && !self.sums_skip_first.get());
        if ran != sum_launches || self.sums_next.get() % 2 == 1 {
            bail!(
                "internal error: a pass ran {ran} launches into 64-bit sums where sums_in_pass counted {sum_launches}"
            );
        }
        Ok(())
    }

    /// One decoder layer over `t` tokens; on entry `s.a` holds `x`'s input norm, or `pending` the
    /// residual step that gives it; returns the layer's last residual step (whose norm with
    /// `next_norm` is the next input), not run yet.
    fn layer(
        &self,
        lp: &LayerPlan,
        lw: &DevLayer,
        next_norm: u64,
        t: usize,
        pending: Option<PendingNorm>,
    ) -> Result<PendingNorm> {
        let m = &*self.model;
        let (plan, s) = (&m.plan, &self.s);
        let (h, hd, eps) = (plan.hidden, lp.head_dim, plan.eps);
        let pos = self.s.meta.ptr;

        // 3–15: Q, and on layers that own a cache K and V; q_norm + RoPE, k_norm + RoPE, v_norm;
        // attention over the source layer's cache. With `fuse_norms` (the megakernel's stage
        // table, by default) a pass of up to eight tokens keeps the projections raw (K/V in
        // `kr`/`vr`) and the attention kernel norms them (`AttentionNorms`; each block norms the
        // pass's keys in its range, so not for longer passes); otherwise K/V go straight into the
        // staging rows and `qkv_norm_rope` norms them in place first.
        let long = self.long_pass(t);
        let gpu = self.gpu();
        // A batched step's columns have their own positions: only the attention knows them.
        let batched = self.batched.get();
        let fused = !long
            && t <= AttentionSplit::FEW_TOKENS
            && (batched || gpu.fuse_norms.unwrap_or_else(|| gpu.is_recording()));
        let mut norms = AttentionNorms {
            fused: if fused { ATT_FUSED_Q } else { 0 },
            q_norm: lw.q_norm,
            inv_freq: lw.inv_freq,
            k_norm: 0,
            kr: 0,
            vr: 0,
        };
        // qkv_norm_rope's K and V arguments: rows, k_norm weight, heads, rows, heads (none: 0).
        let mut kv_norms = (0, 0, 0, 0, 0);
        match (&lw.k, lw.k_norm, &self.caches[lp.index]) {
            (Some(wk), Some(k_norm), Some(c)) => {
                let (k, v) = if fused { (s.kr.ptr, s.vr.ptr) } else { (c.staged_k.ptr, c.staged_v.ptr) };
                match &lw.v {
                    Some(wv) => self.matvec_after(&[(&lw.q, s.q.ptr), (wk, k), (wv, v)], s.a.ptr, pending, 0, t)?,
                    None => self.matvec_after(&[(&lw.q, s.q.ptr), (wk, k)], s.a.ptr, pending, 0, t)?,
                }
                let nv = if plan.v_norm { lp.num_kv_heads } else { 0 };
                // k_eq_v (no V projection): values are the raw key projection (before k_norm and RoPE).
                if fused {
                    norms.fused |= ATT_FUSED_KV | if nv > 0 { ATT_FUSED_VNORM } else { 0 };
                    (norms.k_norm, norms.kr, norms.vr) = (k_norm, k, if lw.v.is_some() { v } else { k });
                } else {
                    if lw.v.is_none() {
                        let n = t * c.width;
                        self.elementwise("copy", n, &[Arg::Ptr(v), Arg::Ptr(k), Arg::U64(n as u64)])?
                    }
                    kv_norms = (k, k_norm, lp.num_kv_heads, v, nv);
                }
            }
            _ => self.matvec_after(&[(&lw.q, s.q.ptr)], s.a.ptr, pending, 0, t)?,
        }
        if !fused {
            let (k, k_norm, nk, v, nv) = kv_norms;
            let args = [
                Arg::Ptr(s.q.ptr),
                Arg::Ptr(lw.q_norm),
                Arg::I32(lp.num_heads as i32),
                Arg::Ptr(k),
                Arg::Ptr(k_norm),
                Arg::I32(nk as i32),
                Arg::Ptr(v),
                Arg::I32(nv as i32),
                Arg::Ptr(lw.inv_freq),
                Arg::I32(hd as i32),
                Arg::Ptr(pos),
                Arg::I32(t as i32),
                Arg::F32(eps),
            ];
            self.gpu().launch("qkv_norm_rope", (t * (lp.num_heads + nk + nv)) as u32, 256, 0, &args)?;
        }
        if long {
            self.attention_long(lp, t)?;
        } else {
            self.attention(lp, t, &norms)?;
        }

        // O projection; the post-attention norm and residual, then the pre-feed-forward norm
        // (folded into the feed-forward's first matvec).
        let o = self.matvec_sum(&lw.o, s.att.ptr, None, s.o.ptr, t)?;
        let post_attn = PendingNorm { o, w1: lw.post_attn_norm, scale: 1.0, w2: lw.pre_ffn_norm };

        // 16–19: feed-forward (dense MLP, plus the MoE branch, which reads the MLP's output as it is).
        let f = self.mlp(&lw.gate, &lw.up, &lw.down, post_attn, s.f.ptr, t, lw.moe.is_none())?;
        if let Some(moe) = &lw.moe {
            self.norm(s.f.ptr, s.f.ptr, moe.post_norm_1, h, t, false)?;
            self.moe(moe, t)?;
            self.elementwise("add", t * h, &[Arg::Ptr(s.f.ptr), Arg::Ptr(s.e.ptr), Arg::U64((t * h) as u64)])?;
        }

        // 20–25: per-layer embedding injection, the per-layer scalar, the next norm.
        let post_ffn = PendingNorm { o: f, w1: lw.post_ffn_norm, scale: 1.0, w2: 0 };
        Ok(match &lw.ple {
            Some(ple) => {
                let p = plan.ple_dim;
                let lpw = plan.layers.len() * p;
                // The PLE gate reads the residual after the feed-forward step itself (no norm).
                self.matvec_after(&[(&ple.gate, s.pg.ptr)], self.xcur(), Some(post_ffn), 0, t)?;
                let gate = Gate { ptr: s.pli.at(f32s(lp.index * p)), stride: lpw };
                let o = self.matvec_sum(&ple.proj, s.pg.ptr, Some(gate), s.o.ptr, t)?;
                PendingNorm { o, w1: ple.post_norm, scale: lw.layer_scalar, w2: next_norm }
            }
            None => PendingNorm { scale: lw.layer_scalar, w2: next_norm, ..post_ffn },
        })
    }

    /// The residual step `p` of `t` rows — `x = (x + norm(o)·w1) · scale`, then `a = norm(x)·w2`
    /// when `w2` is non-zero — each row in `slices` blocks (`norm_slices`): in place with one, else
    /// x' into the other residual buffer, which becomes the current one. `prep`: run as the
    /// prepared-input entry given, which also writes the output's digit planes to the buffer given
    /// (`add_norm_prep_*`).
    fn add_norm(&self, p: PendingNorm, t: usize, slices: usize, prep: Option<(&str, u64)>) -> Result<()> {
        let (h, eps) = (self.model.plan.hidden, self.model.plan.eps);
        let x_out = if slices > 1 { self.xother() } else { self.xcur() };
        let mut args = vec![
            Arg::Ptr(self.xcur()),
            Arg::Ptr(p.o),
            Arg::Ptr(p.w1),
            Arg::F32(p.scale),
            Arg::Ptr(self.s.a.ptr),
            Arg::Ptr(p.w2),
            Arg::I32(h as i32),
            Arg::F32(eps),
        ];
        args.extend(prep.map(|(_, buf)| Arg::Ptr(buf)));
        args.extend([Arg::Ptr(x_out), Arg::I32(slices as i32)]);
        let kernel = prep.map_or("add_norm", |(step, _)| step);
        // 256 threads per row (every decode-step kernel has blocks of 256, as the megakernel runs them).
        self.gpu().launch(kernel, (t * slices) as u32, 256, 0, &args)?;
        if slices > 1 {
            self.x_in_x2.set(!self.x_in_x2.get());
        }
        Ok(())
    }

    /// Attention of the pass's `t` tokens over this sequence's cache, or in a batched step of
    /// each column over its own sequence's cache (the table `step_batch` uploaded).
    fn attention(&self, lp: &LayerPlan, t: usize, norms: &AttentionNorms) -> Result<()> {
        if self.batched.get() {
            let cols = self.s.att_cols.ptr + (lp.index * MAX_BATCH * std::mem::size_of::<AttColumnDesc>()) as u64;
            return self.attention_launch(lp, KvView::default(), t, norms, cols);
        }
        let Some(c) = &self.caches[lp.kv_source] else { bail!("layer {} has no KV cache", lp.kv_source) };
        self.attention_launch(lp, c.view(), t, norms, 0)
    }

    /// Attention of the pass's `t` tokens over the cache `c`, or (`cols` non-zero) over each
    /// column's cache from that table.
    fn attention_launch(&self, lp: &LayerPlan, c: KvView, t: usize, norms: &AttentionNorms, cols: u64) -> Result<()> {
        let s = &self.s;
        let io = AttIo {
            q: s.q.ptr,
            out: s.att.ptr,
            pos: s.meta.ptr,
            part_o: s.att_o.ptr,
            part_ml: s.att_ml.ptr,
            counters: s.att_counters.ptr,
            window: lp.window.unwrap_or(0),
            // Sized for the most keys any pass of this sequence can see, so a captured graph fits every step.
            max_keys: attention_keys(lp, self.max_len),
            scale: self.model.plan.attn_scale,
        };
        self.launch_attention(lp, c, t, norms, cols, &io)
    }

    /// The attention kernel over `io`'s buffers (the heads and head dim of `lp`).
    pub(crate) fn launch_attention(
        &self,
        lp: &LayerPlan,
        c: KvView,
        t: usize,
        norms: &AttentionNorms,
        cols: u64,
        io: &AttIo,
    ) -> Result<()> {
        if lp.head_dim > 512 || !lp.head_dim.is_multiple_of(4) {
            bail!("head dim {} is not one the attention kernel takes (a multiple of 4, at most 512)", lp.head_dim);
        }
        let split_keys = self.gpu().att_split_keys;
        let split = AttentionSplit::new(io.max_keys, t, split_keys);
        // The query, per-warp sums, with fused K/V norms the range's normed K/V rows, and scores.
        let staged_rows = if norms.fused & ATT_FUSED_KV != 0 { t.min(split.keys_per_block) } else { 0 };
        let smem = f32s(lp.head_dim * (1 + ATTENTION_WARPS + 2 * staged_rows) + split.keys_per_block);
        if smem > 200 * 1024 {
            bail!("attention needs {smem} bytes of shared memory per block (at most 200 KB)");
        }
        let args = [
            Arg::Ptr(io.q),
            Arg::Ptr(c.k),
            Arg::Ptr(c.v),
            Arg::Ptr(c.staged_k),
            Arg::Ptr(c.staged_v),
            Arg::Ptr(io.out),
            Arg::I32(lp.num_heads as i32),
            Arg::I32(lp.num_kv_heads as i32),
            Arg::I32(lp.head_dim as i32),
            Arg::Ptr(io.pos),
            Arg::I32(io.window as i32),
            Arg::I32(c.ring as i32),
            Arg::F32(io.scale),
            Arg::I32(t as i32),
            Arg::I32(split.grid_splits as i32),
            Arg::Ptr(io.part_o),
            Arg::Ptr(io.part_ml),
            Arg::Ptr(io.counters),
            Arg::I32(split_keys as i32),
            Arg::I32(norms.fused),
            Arg::Ptr(norms.q_norm),
            Arg::Ptr(norms.k_norm),
            Arg::Ptr(norms.inv_freq),
            Arg::F32(self.model.plan.eps),
            Arg::Ptr(norms.kr),
            Arg::Ptr(norms.vr),
            Arg::Ptr(cols),
        ];
        let grid = (t * lp.num_heads * split.grid_splits) as u32;
        // A decode step (one token, no column table) runs the entry built for its head dim; a
        // megakernel's stage table dispatches the general one.
        let one = self.gpu().att_one && t == 1 && cols == 0 && !self.gpu().is_recording();
        let name = match (one, lp.head_dim) {
            (true, 256) => "attention_1_256",
            (true, 512) => "attention_1_512",
            _ => "attention",
        };
        self.gpu().launch(name, grid, (ATTENTION_WARPS * 32) as u32, smem as u32, &args)
    }

    /// `out = down(gelu(gate·a) · up·a)` for `t` columns, `a` the input the pending residual
    /// step gives.
    /// The dense MLP into `out`; returns where its output is read (`matvec_sum`, when `sum`: the
    /// output is only a residual step's input).
    #[allow(clippy::too_many_arguments)]
    fn mlp(
        &self,
        gate: &DevMat,
        up: &DevMat,
        down: &DevMat,
        pending: PendingNorm,
        out: u64,
        t: usize,
        sum: bool,
    ) -> Result<u64> {
        let s = &self.s;
        self.matvec_after(&[(gate, s.g.ptr), (up, s.u.ptr)], s.a.ptr, Some(pending), 0, t)?;
        let g = Gate { ptr: s.u.ptr, stride: gate.rows as usize };
        if sum {
            return self.matvec_sum(down, s.g.ptr, Some(g), out, t);
        }
        self.matvec_gated(down, s.g.ptr, g, out, t)?;
        Ok(out)
    }

    /// MoE branch into `s.e`: route, run every expert on the pre-normed input, combine the top-k
    /// in routing order, `post_feedforward_layernorm_2`.
    fn moe(&self, moe: &DevMoe, t: usize) -> Result<()> {
        let (plan, s) = (&self.model.plan, &self.s);
        let h = plan.hidden;
        let e_count = moe.experts.len();
        let k = plan.moe_top_k.min(e_count);
        if e_count > 256 {
            bail!("{e_count} experts: the router kernel handles at most 256");
        }
        self.norm(s.zr.ptr, self.xcur(), 0, h, t, false)?;
        let root = (h as f64).powf(-0.5) as f32;
        let args =
            [Arg::Ptr(s.zr.ptr), Arg::Ptr(moe.router_scale), Arg::F32(root), Arg::I32(h as i32), Arg::I32(t as i32)];
        self.elementwise("router_scale", t * h, &args)?;
        self.matvec(&moe.router, s.zr.ptr, s.rl.ptr, t)?;
        let args = [
            Arg::Ptr(s.rl.ptr),
            Arg::Ptr(moe.per_expert_scale),
            Arg::Ptr(s.idx.ptr),
            Arg::Ptr(s.wts.ptr),
            Arg::I32(e_count as i32),
            Arg::I32(k as i32),
            Arg::I32(t as i32),
        ];
        // Blocks of 256 threads, as every stage the megakernel runs (one thread per token).
        self.gpu().launch("moe_route", t.div_ceil(256) as u32, 256, 0, &args)?;
        self.norm(s.a.ptr, self.xcur(), moe.pre_norm_2, h, t, false)?;
        // Only each token's k routed experts run: (token, slot) pairs p = t·k + s.
        let pairs = t * k;
        let inter = moe.experts[0][0].rows as usize;
        let experts = |which: i32, x: u64, x_per_pair: bool, y: u64, rows: usize| {
            let row_blocks = rows.div_ceil(MATVEC_ROWS_PER_BLOCK);
            let args = [
                Arg::Ptr(moe.table),
                Arg::I32(which),
                Arg::Ptr(s.idx.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(x),
                Arg::I32(x_per_pair as i32),
                Arg::Ptr(y),
                Arg::I32(row_blocks as i32),
            ];
            let grid = (row_blocks * pairs) as u32;
            self.gpu().launch("matvec_experts", grid, (MATVEC_ROWS_PER_BLOCK * 32) as u32, 0, &args)
        };
        experts(0, s.a.ptr, false, s.g.ptr, inter)?;
        experts(1, s.a.ptr, false, s.u.ptr, inter)?;
        self.gelu_gate_in_place(s.g.ptr, Gate { ptr: s.u.ptr, stride: inter }, inter, pairs)?;
        experts(2, s.g.ptr, true, s.ys.ptr, h)?;
        let args = [
            Arg::Ptr(s.e.ptr),
            Arg::Ptr(s.ys.ptr),
            Arg::Ptr(s.wts.ptr),
            Arg::I32(k as i32),
            Arg::I32(h as i32),
            Arg::I32(t as i32),
        ];
        self.elementwise("moe_combine", t * h, &args)?;
        self.norm(s.e.ptr, s.e.ptr, moe.post_norm_2, h, t, false)
    }
}
