//! Law 32, calendar budgets, as property tests on instants built by hand. Law numbers are
//! those of `crates/tower-limits/docs/laws.md`. The law lives beside the core, whose
//! algorithm it checks, so that mutation testing of the algorithm builds the core alone.
//!
//! A [`CalendarWindow`] is checked against a model written another way: the model names
//! each instant's period by its civil date in the zone (the day, the ISO week, the month
//! or the year) and finds the next period's first midnight from the last day of the
//! current one, where the window computes the period's first day and adds a calendar
//! span. Random zones (half-hour and 30-minute daylight-saving shifts included), random
//! origins near daylight-saving changes and month ends, and steps that land on the exact
//! nanosecond of a boundary, one before and one after:
//!
//! - **Exact budget.** A cost is granted exactly when the settled usage of the current
//!   period (grants, less refunds, plus charges, made while the period lasts) plus the
//!   cost is within the limit; so a period never admits more than its amount counting
//!   settled usage, and the budget never refuses what fits.
//! - **Exact reset.** A refusal's wait and the snapshot's `reset` both end on the next
//!   period's first instant, across daylight-saving changes and month ends; the
//!   snapshot's `remaining` is what a check would grant.
//! - **Settling stays in its period.** A refund or charge of a grant from an ended period
//!   changes nothing.
//! - **Forgetting is safe.** A state is idle exactly when nothing is counted in the
//!   current period, and an idle state decides like a fresh one.
//! - **Through a set.** Grants settled, cancelled and dropped give their cost back to the
//!   period, and the set's snapshot reports the same reset.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use proptest::prelude::*;
use proptest::sample::Index;
use tower_limits_core::algorithm::{Algorithm, CalendarPeriod, CalendarWindow, Refusal};
use tower_limits_core::{AcquireError, Instant, LimitPolicy, LimitSet, LimitSetPolicy, TenantKey};

/// Failing cases are kept next to this file and replayed first.
fn proptest_config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

const SECOND: u64 = 1_000_000_000;
const HOUR: u64 = 3600 * SECOND;

const ZONES: [&str; 6] =
    ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kathmandu", "America/Santiago", "UTC"];

/// The model: a period's identity and the first instant of the next one, in Unix
/// nanoseconds.
struct Model {
    zone: TimeZone,
    period: CalendarPeriod,
    origin: i128,
}

impl Model {
    fn date(&self, now: Instant) -> Date {
        let t = Timestamp::from_nanosecond(self.origin + i128::from(now.as_nanos())).unwrap();
        t.to_zoned(self.zone.clone()).date()
    }

    fn period_id(&self, now: Instant) -> (i16, i16) {
        let d = self.date(now);
        match self.period {
            CalendarPeriod::Day => (d.year(), d.day_of_year()),
            CalendarPeriod::Week => {
                let w = d.iso_week_date();
                (w.year(), i16::from(w.week()))
            }
            CalendarPeriod::Month => (d.year(), i16::from(d.month())),
            CalendarPeriod::Year => (d.year(), 0),
        }
    }

    /// The next period's first instant: the day after the current period's last day.
    fn next_start(&self, now: Instant) -> Instant {
        let d = self.date(now);
        let last = match self.period {
            CalendarPeriod::Day => d,
            CalendarPeriod::Week => d.checked_add((6 - i64::from(d.weekday().to_monday_zero_offset())).days()).unwrap(),
            CalendarPeriod::Month => d.last_of_month(),
            CalendarPeriod::Year => d.last_of_year(),
        };
        let next = last.tomorrow().unwrap().to_zoned(self.zone.clone()).unwrap();
        Instant::from_nanos(u64::try_from(next.timestamp().as_nanosecond() - self.origin).unwrap())
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    /// Move the clock this far.
    Wait(u64),
    /// Move the clock to the next boundary, shifted by -1, 0 or +1 nanosecond.
    ToBoundary(i8),
    Acquire(u64),
    Refund(Index, u64),
    Charge(Index, u64),
}

fn steps(limit: u64) -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        3 => prop_oneof![0..=SECOND, 0..=6 * HOUR, 0..=40 * 24 * HOUR].prop_map(Step::Wait),
        2 => (-1i8..=1).prop_map(Step::ToBoundary),
        8 => prop_oneof![Just(1u64), 0..=limit, Just(limit + 1)].prop_map(Step::Acquire),
        2 => (any::<Index>(), 0..=limit).prop_map(|(i, a)| Step::Refund(i, a)),
        2 => (any::<Index>(), 0..=limit).prop_map(|(i, a)| Step::Charge(i, a)),
    ];
    prop::collection::vec(step, 1..120)
}

/// Origins in 2024 to 2030, half of them a few hours before a boundary of the zone's
/// daylight-saving rules or a month's end.
fn origin() -> impl Strategy<Value = i128> {
    let year = 365 * 24 * 3600i128;
    prop_oneof![
        (0..6 * year).prop_map(|s| (1_704_067_200 + s) * 1_000_000_000),
        (0usize..6, 0i128..12, 0..48 * 3600i128).prop_map(|(y, m, s)| {
            // The last Sunday of March and October are Europe's changes; ends of months.
            let month_end = jiff::civil::date(2024 + y as i16, 1 + m as i8, 1).last_of_month();
            let t = month_end.to_zoned(TimeZone::UTC).unwrap().timestamp().as_second();
            (i128::from(t) - 24 * 3600 + s) * 1_000_000_000
        }),
    ]
}

fn period() -> impl Strategy<Value = CalendarPeriod> {
    prop_oneof![
        Just(CalendarPeriod::Day),
        Just(CalendarPeriod::Week),
        Just(CalendarPeriod::Month),
        Just(CalendarPeriod::Year)
    ]
}

fn system_time(unix_nanos: i128) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(u64::try_from(unix_nanos).unwrap())
}

struct Grant {
    at: Instant,
    period: (i16, i16),
}

proptest! {
    #![proptest_config(proptest_config(256))]

    #[test]
    fn a_calendar_budget_is_exact_per_period_and_resets_on_the_calendar(
        zone in prop::sample::select(&ZONES[..]),
        period in period(),
        origin in origin(),
        limit in 1u64..50,
        steps in steps(50),
    ) {
        let window = CalendarWindow::new(limit, period, zone).unwrap().with_origin(system_time(origin));
        let model = Model { zone: TimeZone::get(zone).unwrap(), period, origin };
        let mut state = window.fresh();
        let mut now = Instant::ZERO;
        let mut grants: Vec<Grant> = Vec::new();
        // The model's settled usage of the current period.
        let mut used_in: ((i16, i16), u64) = (model.period_id(now), 0);
        for step in steps {
            match step {
                Step::Wait(d) => now = Instant::from_nanos(now.as_nanos() + d),
                Step::ToBoundary(shift) => {
                    let b = model.next_start(now).as_nanos();
                    now = Instant::from_nanos(b.saturating_add_signed(i64::from(shift)).max(now.as_nanos()));
                }
                Step::Acquire(cost) => {
                    let id = model.period_id(now);
                    if used_in.0 != id {
                        used_in = (id, 0);
                    }
                    let answer = window.check(&state, now, cost);
                    let expected = if cost > limit {
                        Err(Refusal::Never { capacity: limit })
                    } else if used_in.1 + cost <= limit {
                        Ok(())
                    } else {
                        Err(Refusal::NotYet {
                            retry_after: Some(model.next_start(now).saturating_since(now)),
                        })
                    };
                    prop_assert_eq!(answer, expected, "cost {} at {:?}, {} used of {}", cost, now, used_in.1, limit);
                    if answer.is_ok() {
                        window.commit(&mut state, now, cost);
                        used_in.1 += cost;
                        grants.push(Grant { at: now, period: id });
                    }
                }
                Step::Refund(pick, amount) | Step::Charge(pick, amount) => {
                    if grants.is_empty() {
                        continue;
                    }
                    let g = &grants[pick.index(grants.len())];
                    let current = model.period_id(now) == g.period && used_in.0 == g.period;
                    if let Step::Refund(..) = step {
                        window.refund(&mut state, now, g.at, amount);
                        if current {
                            used_in.1 = used_in.1.saturating_sub(amount);
                        }
                    } else {
                        window.charge(&mut state, now, g.at, amount);
                        if current {
                            used_in.1 += amount;
                        }
                    }
                }
            }
            // The snapshot: what a check grants, and the reset on the calendar.
            let id = model.period_id(now);
            let used = if used_in.0 == id { used_in.1 } else { 0 };
            let snap = window.peek(&state, now);
            prop_assert_eq!(snap.remaining, limit.saturating_sub(used));
            prop_assert_eq!(snap.reset, model.next_start(now).saturating_since(now));
            // Nothing counted in the current period is idle: the key can be forgotten.
            prop_assert_eq!(window.is_idle(&state, now), used == 0);
            if window.is_idle(&state, now) {
                for cost in [1, limit / 2 + 1, limit] {
                    prop_assert_eq!(window.check(&state, now, cost), window.check(&window.fresh(), now, cost));
                }
                prop_assert_eq!(snap.remaining, window.peek(&window.fresh(), now).remaining);
            }
        }
    }
}

/// Through a set, keyed per team, on a manual clock's instants: grants settled down and
/// cancelled give their cost back to the month; a charge above the budget refuses the
/// rest of the month; the first instant of the next month (midnight in Berlin) grants the
/// whole budget again, and April is 30 days long.
#[test]
fn a_team_budget_in_a_set_settles_cancels_and_renews_on_the_first_of_the_month() {
    let berlin = TimeZone::get("Europe/Berlin").unwrap();
    let start = jiff::civil::date(2026, 3, 31).at(20, 0, 0, 0).to_zoned(berlin.clone()).unwrap();
    let origin = system_time(start.timestamp().as_nanosecond());
    let budget = LimitPolicy::calendar_window("usd-month", 1_000, CalendarPeriod::Month, "Europe/Berlin")
        .per("team")
        .counting_cost()
        .with_clock_origin(origin);
    let set = LimitSet::new(LimitSetPolicy::new().tiers(["team"]).limit(budget)).unwrap();
    let team = TenantKey::new(["ops"]).unwrap();
    let now = Instant::ZERO;

    let mut grant = set.acquire_grant(&team, 600, now).unwrap();
    set.settle_grant(&team, &mut grant, 250, now);
    set.release_grant(&team, grant);
    let cancelled = set.acquire_grant(&team, 700, now).unwrap();
    set.cancel_grant(&team, cancelled, now);
    assert_eq!(set.peek(&team, now)[0].snapshot.remaining, 750);

    let mut overrun = set.acquire_grant(&team, 700, now).unwrap();
    set.settle_grant(&team, &mut overrun, 900, now);
    set.release_grant(&team, overrun);
    let Err(AcquireError::Refused(refused)) = set.acquire(&team, 1, now) else { panic!("a spent budget refuses") };
    let midnight = Duration::from_secs(4 * 3600); // 20:00 to midnight in Berlin
    assert_eq!((refused.limit(), refused.retry_after()), ("usd-month", midnight));
    assert_eq!(set.peek(&team, now)[0].snapshot.reset, midnight);

    let april = now + midnight;
    assert!(set.acquire(&team, 1, april - Duration::from_nanos(1)).is_err());
    assert!(set.acquire(&team, 1_000, april).is_ok());
    let may = jiff::civil::date(2026, 5, 1).to_zoned(berlin).unwrap().timestamp();
    let april_len = may.as_nanosecond() - start.timestamp().as_nanosecond() - i128::from(midnight.as_nanos() as u64);
    assert_eq!(april_len, i128::from(30 * 24 * HOUR), "April is 30 days of 24 hours");
    assert_eq!(set.peek(&team, april)[0].snapshot.window, Duration::from_nanos(30 * 24 * HOUR));
}
