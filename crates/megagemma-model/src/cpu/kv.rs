//! KV cache of the CPU backend.
//!
//! One cache per layer that owns K/V (KV-shared layers read their donor's). Full-attention
//! layers keep every position; sliding layers keep a ring of `W + 1` slots (slot = pos mod
//! (W + 1)), so their memory never grows past the window: a target query needs the W newest
//! keys, the MTP drafter (which queries from the position after the newest one) the W + 1 newest. A multi-token pass does not write the ring
//! while it runs: its rows are *staged* and committed afterwards — all of them for prefill and
//! decode, only the accepted ones after a speculative verify — because a candidate's ring slot
//! may still hold a key that an earlier query in the same pass (or the next pass, after a
//! rejection) must see.

use crate::plan::ModelPlan;
use crate::{bail, Result};

#[derive(Clone)]
pub struct LayerKv {
    width: usize,
    /// Ring slots (`W + 1`) of a sliding layer; `None` for full attention.
    ring: Option<usize>,
    /// The sliding window `W` itself.
    window: Option<usize>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Staged rows for positions `committed .. committed + staged`.
    staged_k: Vec<f32>,
    staged_v: Vec<f32>,
}

impl LayerKv {
    fn slot(&self, pos: usize) -> usize {
        match self.ring {
            Some(w) => pos % w,
            None => pos,
        }
    }
    pub fn key(&self, pos: usize) -> &[f32] {
        let s = self.slot(pos);
        &self.k[s * self.width..(s + 1) * self.width]
    }
    pub fn value(&self, pos: usize) -> &[f32] {
        let s = self.slot(pos);
        &self.v[s * self.width..(s + 1) * self.width]
    }
    pub fn staged_key(&self, i: usize) -> &[f32] {
        &self.staged_k[i * self.width..(i + 1) * self.width]
    }
    pub fn staged_value(&self, i: usize) -> &[f32] {
        &self.staged_v[i * self.width..(i + 1) * self.width]
    }
    /// Store one position's K/V in its slot, growing the buffers up to that slot (positions in
    /// order for full layers; a ring fills up to `window` slots, then overwrites).
    fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let (s, w) = (self.slot(pos), self.width);
        if self.k.len() < (s + 1) * w {
            self.k.resize((s + 1) * w, 0.0);
            self.v.resize((s + 1) * w, 0.0);
        }
        self.k[s * w..(s + 1) * w].copy_from_slice(k);
        self.v[s * w..(s + 1) * w].copy_from_slice(v);
    }
    /// Floats held by committed rows (for memory checks).
    pub fn resident_rows(&self) -> usize {
        self.k.len() / self.width
    }
}

#[derive(Clone)]
pub struct KvCache {
    /// Indexed by layer; `None` for KV-shared layers.
    layers: Vec<Option<LayerKv>>,
    /// Committed positions.
    len: usize,
    /// Staged positions (rows after `len`), not yet visible to later passes.
    staged: usize,
}

impl KvCache {
    pub fn new(plan: &ModelPlan) -> KvCache {
        let layers = plan
            .layers
            .iter()
            .map(|l| {
                (!l.is_kv_shared()).then(|| LayerKv {
                    width: l.kv_width(),
                    ring: l.window.map(|w| w + 1),
                    window: l.window,
                    k: Vec::new(),
                    v: Vec::new(),
                    staged_k: Vec::new(),
                    staged_v: Vec::new(),
                })
            })
            .collect();
        KvCache { layers, len: 0, staged: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn staged(&self) -> usize {
        self.staged
    }
    pub fn layer(&self, i: usize) -> &LayerKv {
        self.layers[i].as_ref().expect("layer owns no KV cache")
    }

    /// Begin a pass of `n` tokens: drop any earlier staged rows and reserve staging space.
    pub fn begin_stage(&mut self, n: usize) {
        self.staged = n;
        for l in self.layers.iter_mut().flatten() {
            l.staged_k.clear();
            l.staged_v.clear();
            l.staged_k.reserve(n * l.width);
            l.staged_v.reserve(n * l.width);
        }
    }

    /// Append one staged row (K and V of `n` consecutive tokens, `[n, width]` each) for a layer.
    pub fn stage_rows(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let l = self.layers[layer].as_mut().expect("layer owns no KV cache");
        l.staged_k.extend_from_slice(k);
        l.staged_v.extend_from_slice(v);
    }

    /// Make the first `accepted` staged rows part of the cache and drop the rest.
    pub fn commit(&mut self, accepted: usize) -> Result<()> {
        if accepted > self.staged {
            bail!("cannot commit {accepted} rows: only {} are staged", self.staged);
        }
        let start = self.len;
        for l in self.layers.iter_mut().flatten() {
            let w = l.width;
            // Rows that would be overwritten within this same commit never need writing.
            let skip = l.ring.map_or(0, |n| accepted.saturating_sub(n));
            let (staged_k, staged_v) = (std::mem::take(&mut l.staged_k), std::mem::take(&mut l.staged_v));
            for i in skip..accepted {
                l.write(start + i, &staged_k[i * w..(i + 1) * w], &staged_v[i * w..(i + 1) * w]);
            }
            // Hand the staging buffers back, emptied, so their capacity is reused.
            (l.staged_k, l.staged_v) = (staged_k, staged_v);
            l.staged_k.clear();
            l.staged_v.clear();
        }
        self.len += accepted;
        self.staged = 0;
        Ok(())
    }

    /// Roll the committed length back to `len`. Full-attention caches always can; a sliding
    /// ring only if every key a query at `len` needs is still in it.
    pub fn truncate_to(&mut self, len: usize) -> Result<()> {
        self.staged = 0;
        if len >= self.len {
            if len > self.len {
                bail!("cannot truncate to {len}: only {} positions are cached", self.len);
            }
            return Ok(());
        }
        if len == 0 {
            self.clear();
            return Ok(());
        }
        for l in self.layers.iter_mut().flatten() {
            if let (Some(n), Some(w)) = (l.ring, l.window) {
                // The ring holds [len_old − n, len_old); the position after `len` needs the
                // W + 1 newest keys before it (the drafter's view): [len − W, len).
                let oldest = self.len.saturating_sub(n);
                let needed = len.saturating_sub(w);
                if needed < oldest {
                    bail!(
                        "cannot roll back from {} to {len}: the sliding-window cache no longer holds position {needed}",
                        self.len
                    );
                }
            }
        }
        for l in self.layers.iter_mut().flatten() {
            l.staged_k.clear();
            l.staged_v.clear();
            match l.ring {
                Some(n) if self.len > n => {} // slots stay; positions ≥ len are simply ignored
                _ => {
                    l.k.truncate(len * l.width);
                    l.v.truncate(len * l.width);
                }
            }
        }
        self.len = len;
        Ok(())
    }

    pub fn clear(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.k.clear();
            l.v.clear();
            l.staged_k.clear();
            l.staged_v.clear();
        }
        self.len = 0;
        self.staged = 0;
    }

    /// Committed rows resident per cache layer (layer index, rows).
    pub fn resident_rows(&self) -> Vec<(usize, usize)> {
        self.layers.iter().enumerate().filter_map(|(i, l)| l.as_ref().map(|l| (i, l.resident_rows()))).collect()
    }
}
