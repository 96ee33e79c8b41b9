//! Progress bars on stderr, shown only when stderr is a terminal (never in logs, pipes or
//! tests, where the plain one-line messages stay as they are).

pub use indicatif::ProgressBar;
use indicatif::ProgressStyle;
use std::io::IsTerminal;
use std::time::Duration;

fn interactive() -> bool {
    std::io::stderr().is_terminal()
}

/// A spinner with elapsed time for work of unknown length; `None` off a terminal.
pub fn spinner(message: impl Into<String>) -> Option<ProgressBar> {
    if !interactive() {
        return None;
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("valid progress template"));
    bar.set_message(message.into());
    bar.enable_steady_tick(Duration::from_millis(120));
    Some(bar)
}

/// A bar over `total` bytes; `None` off a terminal.
pub fn bytes(total: u64, message: impl Into<String>) -> Option<ProgressBar> {
    bar(total, message, "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
}

/// A bar over `total` items (tensors, layers); `None` off a terminal.
pub fn items(total: u64, message: impl Into<String>) -> Option<ProgressBar> {
    bar(total, message, "{msg} [{bar:30}] {pos}/{len} ({elapsed}, eta {eta})")
}

fn bar(total: u64, message: impl Into<String>, template: &str) -> Option<ProgressBar> {
    if !interactive() {
        return None;
    }
    let bar = ProgressBar::new(total);
    bar.set_style(ProgressStyle::with_template(template).expect("valid progress template").progress_chars("=> "));
    bar.set_message(message.into());
    Some(bar)
}

/// Remove a bar (or spinner) from the terminal.
pub fn finish(bar: Option<ProgressBar>) {
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}
