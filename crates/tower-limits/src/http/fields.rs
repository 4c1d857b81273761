//! The `RateLimit-Policy` and `RateLimit` fields and OpenAI's `x-ratelimit-*` family,
//! written from the limits' snapshots: the policy field built once per policy, the state
//! fields in a buffer kept per thread, numbers without the formatting machinery.

use std::fmt::Write as _;
use std::time::Duration;

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use tower_limits_core::{Counts, LimitSnapshot, Snapshot};

use super::{RATELIMIT, RATELIMIT_POLICY, whole_seconds};

/// A structured-field string: printable ASCII, with `"` and `\` escaped.
#[cfg(test)]
fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    write_sf_string(&mut out, text);
    out
}

/// Appends `n` in decimal, without the formatting machinery.
fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

fn write_sf_string(out: &mut String, text: &str) {
    out.push('"');
    if text.bytes().all(|b| matches!(b, b' '..=b'~') && b != b'"' && b != b'\\') {
        // The common name: printable ASCII with nothing to escape, copied at once.
        out.push_str(text);
        out.push('"');
        return;
    }
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
}

fn write_policy_member(out: &mut String, name: &str, s: &Snapshot, is_semaphore: bool) {
    write_sf_string(out, name);
    if is_semaphore || s.window.is_zero() {
        let _ = write!(out, ";q={}", s.quota);
        if is_semaphore {
            out.push_str(";qu=\"concurrent-requests\"");
        }
    } else {
        let (quota, seconds) = quota_per_whole_seconds(s.quota, s.window);
        let _ = write!(out, ";q={quota};w={seconds}");
    }
}

/// `quota` per `window` as the same rate over a whole number of seconds, as the `w`
/// parameter must be: `90` per `1.1s` is `900` per `11s`. A window that has no such form
/// within a year is rounded up, which can only understate the rate.
fn quota_per_whole_seconds(quota: u64, window: Duration) -> (u64, u64) {
    if window.subsec_nanos() == 0 {
        return (quota, window.as_secs());
    }
    let (num, den) = (u128::from(quota) * 1_000_000_000, window.as_nanos());
    let (mut a, mut b) = (num, den);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    match (u64::try_from(num / a), u64::try_from(den / a)) {
        (Ok(q), Ok(w)) if w <= 366 * 86_400 => (q, w),
        _ => (quota, whole_seconds(window)),
    }
}

pub(super) fn write_state_member(out: &mut String, name: &str, s: &Snapshot) {
    write_sf_string(out, name);
    out.push_str(";r=");
    push_u64(out, s.remaining);
    out.push_str(";t=");
    push_u64(out, whole_seconds(s.reset));
}

/// What the `RateLimit-Policy` field of a list of limits depends on: constant for a
/// limit (its name, quota and window), so the field's value is built once per policy.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PolicyMember {
    name: (usize, usize),
    quota: u64,
    window: Duration,
    is_semaphore: bool,
}

impl PolicyMember {
    fn of(name: &'static str, s: &Snapshot, is_semaphore: bool) -> Self {
        PolicyMember { name: (name.as_ptr() as usize, name.len()), quota: s.quota, window: s.window, is_semaphore }
    }
}

/// The most limits whose policy field is cached (a set holds at most 16).
const CACHED_MEMBERS: usize = 16;

/// The `RateLimit-Policy` value of `members`, built once per distinct policy in the
/// process and shared from then on: no allocation and no shared write per answer. The
/// values live as long as the process, like limit names: their number is bounded by the
/// policies a process ever uses (each [`LimitSet::replace_policy`] with new quotas adds
/// one).
///
/// [`LimitSet::replace_policy`]: tower_limits_core::LimitSet::replace_policy
pub(super) fn policy_value<'a>(
    members: impl Iterator<Item = (&'static str, &'a Snapshot, bool)> + Clone,
) -> Option<HeaderValue> {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::{Mutex, PoisonError};

    type Key = ([Option<PolicyMember>; CACHED_MEMBERS], usize);
    static INTERNED: Mutex<Option<HashMap<Key, &'static str>>> = Mutex::new(None);
    thread_local! {
        static RECENT: RefCell<Vec<(Key, Option<HeaderValue>)>> = const { RefCell::new(Vec::new()) };
    }

    let mut key: Key = ([None; CACHED_MEMBERS], 0);
    for (i, (name, s, sem)) in members.clone().enumerate() {
        if i == CACHED_MEMBERS {
            return None;
        }
        key.0[i] = Some(PolicyMember::of(name, s, sem));
        key.1 = i + 1;
    }
    RECENT.with_borrow_mut(|recent| {
        // A value over static bytes: cloning it copies a pointer, validating it is done once.
        // Compared on the members in use only: a key is sixteen slots, mostly empty.
        let used = &key.0[..key.1];
        if let Some((_, value)) = recent.iter().find(|(k, _)| k.1 == key.1 && k.0[..k.1] == *used) {
            return value.clone();
        }
        let text = {
            let mut interned = INTERNED.lock().unwrap_or_else(PoisonError::into_inner);
            *interned.get_or_insert_with(HashMap::new).entry(key).or_insert_with(|| {
                let mut out = String::new();
                for (i, (name, s, sem)) in members.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_policy_member(&mut out, name, s, sem);
                }
                Box::leak(out.into_boxed_str())
            })
        };
        let value = HeaderValue::from_str(text).ok().map(|_| HeaderValue::from_static(text));
        if recent.len() == 8 {
            recent.remove(0);
        }
        recent.push((key, value.clone()));
        value
    })
}

/// Builds a header value in a buffer kept per thread: one allocation, the value's own.
pub(super) fn scratch_value(build: impl FnOnce(&mut String)) -> Option<HeaderValue> {
    use std::cell::RefCell;
    thread_local! {
        static SCRATCH: RefCell<String> = const { RefCell::new(String::new()) };
    }
    SCRATCH.with_borrow_mut(|buf| {
        buf.clear();
        build(buf);
        HeaderValue::from_str(buf).ok()
    })
}

/// Writes the `RateLimit-Policy` and `RateLimit` fields for every limit in `snapshots`.
pub fn write_ratelimit_fields(headers: &mut HeaderMap, snapshots: &[LimitSnapshot]) {
    if snapshots.is_empty() || snapshots.iter().any(|l| l.snapshot.quota == 0) {
        // Nothing read, or a state that could not be read: no field claims one.
        return;
    }
    let members = snapshots.iter().map(|l| (l.name, &l.snapshot, l.is_semaphore));
    let policy = policy_value(members).or_else(|| {
        scratch_value(|out| {
            for (i, l) in snapshots.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_policy_member(out, l.name, &l.snapshot, l.is_semaphore);
            }
        })
    });
    if let Some(policy) = policy {
        headers.insert(RATELIMIT_POLICY, policy);
    }
    let state = scratch_value(|out| {
        for (i, l) in snapshots.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            write_state_member(out, l.name, &l.snapshot);
        }
    });
    if let Some(state) = state {
        headers.insert(RATELIMIT, state);
    }
}

/// Writes the `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` fields that OpenAI
/// clients read, from the tightest rate limit counting requests and the tightest
/// counting cost: the one with the least left, which is what a client may send now.
pub fn write_openai_fields(headers: &mut HeaderMap, snapshots: &[LimitSnapshot]) {
    const NAMES: [[HeaderName; 3]; 2] = [
        [
            HeaderName::from_static("x-ratelimit-limit-requests"),
            HeaderName::from_static("x-ratelimit-remaining-requests"),
            HeaderName::from_static("x-ratelimit-reset-requests"),
        ],
        [
            HeaderName::from_static("x-ratelimit-limit-tokens"),
            HeaderName::from_static("x-ratelimit-remaining-tokens"),
            HeaderName::from_static("x-ratelimit-reset-tokens"),
        ],
    ];
    for (counts, [limit, remaining, reset]) in [Counts::Requests, Counts::Cost].into_iter().zip(NAMES) {
        let tightest = snapshots
            .iter()
            .filter(|l| l.counts == counts && !l.is_semaphore && l.snapshot.quota > 0)
            // What a client may send now is the least that any of them has left.
            .min_by_key(|l| (l.snapshot.remaining, l.snapshot.quota));
        if let Some(l) = tightest {
            headers.insert(limit, HeaderValue::from(l.snapshot.quota));
            headers.insert(remaining, HeaderValue::from(l.snapshot.remaining));
            if let Some(v) = scratch_value(|out| write_go_duration(out, l.snapshot.reset)) {
                headers.insert(reset, v);
            }
        }
    }
}

/// A duration as `6m0s`, `1s` or `250ms`, the way OpenAI's fields write it.
#[must_use]
pub fn go_duration(d: Duration) -> String {
    let mut out = String::new();
    write_go_duration(&mut out, d);
    out
}

fn write_go_duration(out: &mut String, d: Duration) {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms < 1000 {
        push_u64(out, ms);
        out.push_str("ms");
        return;
    }
    let (h, m) = (ms / 3_600_000, (ms / 60_000) % 60);
    if h > 0 {
        push_u64(out, h);
        out.push('h');
    }
    if h > 0 || m > 0 {
        push_u64(out, m);
        out.push('m');
    }
    // Seconds with their fraction, as Go writes them: "1s", "1.5s", "0.25s".
    let s = (ms % 60_000) as f64 / 1000.0;
    let _ = write!(out, "{s}s");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_values_are_built_once_per_process() {
        let s = Snapshot { quota: 5, remaining: 3, reset: Duration::from_secs(1), window: Duration::from_secs(2) };
        let name: &'static str = "policy-cache-test";
        let a = policy_value(std::iter::once((name, &s, false))).unwrap();
        assert_eq!(a, "\"policy-cache-test\";q=5;w=2");
        let b = std::thread::spawn(move || policy_value(std::iter::once((name, &s, false))).unwrap()).join().unwrap();
        assert_eq!(a.as_bytes().as_ptr(), b.as_bytes().as_ptr(), "one value for every thread");
        let other = Snapshot { quota: 6, ..s };
        assert_eq!(policy_value(std::iter::once((name, &other, false))).unwrap(), "\"policy-cache-test\";q=6;w=2");
        let sem = Snapshot { window: Duration::ZERO, ..s };
        let both = policy_value([(name, &s, false), (name, &sem, true)].into_iter()).unwrap();
        assert_eq!(both, "\"policy-cache-test\";q=5;w=2, \"policy-cache-test\";q=5;qu=\"concurrent-requests\"");
    }

    #[test]
    fn windows_become_whole_seconds_without_changing_the_rate() {
        assert_eq!(quota_per_whole_seconds(6_000, Duration::from_secs(60)), (6_000, 60));
        // A mirror's 90 per 1.1 s: 900 per 11 s (rounding 1.1 s up to 2 s read as 45 per s).
        assert_eq!(quota_per_whole_seconds(90, Duration::from_millis(1_100)), (900, 11));
        assert_eq!(quota_per_whole_seconds(2, Duration::from_millis(500)), (4, 1));
        // No whole form within a year: rounded up, which only understates the rate.
        assert_eq!(quota_per_whole_seconds(1, Duration::from_nanos(1_000_000_007)), (1, 2));
    }

    #[test]
    fn go_durations() {
        assert_eq!(go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(go_duration(Duration::from_secs(1)), "1s");
        assert_eq!(go_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
    }

    #[test]
    fn structured_strings_are_escaped() {
        assert_eq!(sf_string("a\"b\\c\u{e9}"), "\"a\\\"b\\\\c_\"");
    }
}
