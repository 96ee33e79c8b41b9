//! CUDA graph capture next to other threads' device-wide calls.
//!
//! A stream capture in progress is invalidated (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`) when
//! another thread makes a call that synchronises the whole device: `cuMemFree` and module unloads
//! do, cuBLAS handles may when created or destroyed, allocations and module loads may. Several
//! models in one process (the GPU tests run five at once; a server could load two) hit it whenever
//! one sequence captures its decode graph while another model is loaded, freed or dropped. So
//! captures hold a shared guard and those calls an exclusive one: captures run concurrently with
//! each other, never with them. A thread already holding the guard does not wait for it again.

use std::cell::Cell;
use std::sync::RwLock;

static CAPTURES: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread holds the guard (shared or exclusive).
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the guard held by this thread (`write`: exclusively), unless it holds it already.
fn with_guard<R>(write: bool, f: impl FnOnce() -> R) -> R {
    if HOLDING.with(|h| h.get()) {
        return f();
    }
    let _shared;
    let _exclusive;
    if write {
        _exclusive = CAPTURES.write().unwrap_or_else(|e| e.into_inner());
    } else {
        _shared = CAPTURES.read().unwrap_or_else(|e| e.into_inner());
    }
    HOLDING.with(|h| h.set(true));
    let r = f();
    HOLDING.with(|h| h.set(false));
    r
}

/// Runs `f` (a whole stream capture) while no device-wide call runs in another thread.
pub(crate) fn capture<R>(f: impl FnOnce() -> R) -> R {
    with_guard(false, f)
}

/// Runs `f` (an allocation, a free, a module load, a device's set-up or tear-down) once no other
/// thread is capturing.
pub(crate) fn device_wide<R>(f: impl FnOnce() -> R) -> R {
    with_guard(true, f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn device_wide_calls_wait_for_captures_in_other_threads() {
        let in_capture = Arc::new(AtomicBool::new(false));
        let flag = in_capture.clone();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let capturer = std::thread::spawn(move || {
            capture(|| {
                flag.store(true, Ordering::SeqCst);
                started_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                // A device-wide call inside the capture's own thread does not wait for itself,
                // nor one nested in another.
                device_wide(|| device_wide(|| ()));
                flag.store(false, Ordering::SeqCst);
            })
        });
        started_rx.recv().unwrap();
        let overlapped = device_wide(|| in_capture.load(Ordering::SeqCst));
        capturer.join().unwrap();
        assert!(!overlapped, "a device-wide call ran while another thread was capturing");
    }
}
