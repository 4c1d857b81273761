//! The buckets of a lease and when a refresh is due, on a manual clock.

use super::*;

fn leases() -> Leases {
    // One member: 10 requests a second with a burst of 2, 100 tokens a second with a
    // burst of 50.
    let rpm = LeasedLimit { interval: 100_000_000, burst: 2, cost: false };
    let tpm = LeasedLimit { interval: 10_000_000, burst: 50, cost: true };
    Leases::new(AccountLeases::new(), vec![vec![rpm, tpm]])
}

fn at(ms: u64) -> Instant {
    Instant::from_nanos(ms * 1_000_000)
}

#[test]
fn a_new_lease_starts_empty_and_refills_at_its_fraction() {
    let l = leases();
    assert_eq!(l.decide(1, &[], at(0)), Decision::NoLease);
    l.granted((WHOLE / 2, WHOLE / 2, 0), at(1000), at(0), at(0));
    // Half of 10 a second: one request every 200 ms, nothing at first.
    assert!(matches!(l.decide(1, &[], at(0)), Decision::Refused(w) if w == Duration::from_millis(200)));
    assert_eq!(l.decide(1, &[], at(200)), Decision::Granted(0));
    assert!(matches!(l.decide(1, &[], at(200)), Decision::Refused(_)));
    // The burst at half is 1: a long pause refills one request, not two.
    assert_eq!(l.decide(1, &[], at(900)), Decision::Granted(0));
    assert!(matches!(l.decide(1, &[], at(900)), Decision::Refused(_)));
    // Expired: nothing is decided locally any more.
    assert_eq!(l.decide(1, &[], at(1000)), Decision::NoLease);
}

#[test]
fn a_refused_request_waits_no_longer_than_the_next_refresh_answer() {
    let l = leases();
    let said = Sent { bands: 0, active: true, short: true, least: 0, cramped: false };
    // A sliver of the rate: the next request in 100 s, were the lease to stay as it is.
    l.heard(at(0), said.clone(), Some(Duration::from_millis(200)), None);
    l.granted((WHOLE / 1000, WHOLE, WHOLE), at(1000), at(0), at(0));
    // (The burst's two requests first.)
    assert_eq!(l.decide(1, &[], at(0)), Decision::Granted(0));
    assert_eq!(l.decide(1, &[], at(0)), Decision::Granted(0));
    let refused = |now: u64| match l.decide(1, &[], at(now)) {
        Decision::Refused(wait) => wait,
        other => panic!("refused at {now} ms, got {other:?}"),
    };
    // Decided again once the period's refresh has answered (2 ms after it is sent).
    assert_eq!(refused(0), Duration::from_millis(202));
    assert_eq!(refused(150), Duration::from_millis(52));
    // Asked to refresh early: until that one.
    l.heard(at(200), said.clone(), Some(Duration::from_millis(800)), Some(Duration::from_millis(30)));
    assert_eq!(refused(210), Duration::from_millis(22));
    // Overdue (slow, or skipped): looked for a quarter of a refresh period (100 ms) on.
    assert_eq!(refused(300), Duration::from_millis(25));
    // A failed refresh: the next is a refresh period on.
    l.failed(at(300));
    assert_eq!(refused(300), Duration::from_millis(102));
}

#[test]
fn a_replica_granted_nothing_refuses_until_the_refresh_it_was_asked_for() {
    let l = leases();
    l.ask_again(Some(Duration::from_millis(50)));
    l.granted((0, 0, 0), at(1000), at(0), at(0));
    assert!(matches!(l.decide(1, &[], at(0)), Decision::Refused(w) if w == Duration::from_millis(50)));
    assert_eq!(l.decide(1, &[], at(50)), Decision::NoLease, "then it asks");
    l.ask_again(None);
    l.granted((0, 0, 0), at(1000), at(100), at(100));
    // Not asked: until the next period's (a refresh period, 100 ms).
    assert_eq!(l.decide(1, &[], at(100)), Decision::Refused(Duration::from_millis(100)));
}

#[test]
fn a_grown_lease_keeps_its_tokens_and_a_shrunk_one_drops_them_when_it_reports() {
    let l = leases();
    l.granted((WHOLE / 2, WHOLE / 2, 0), at(10_000), at(0), at(0));
    assert_eq!(l.fractions(at(0)).0, WHOLE / 2);
    // Full at half: one request. Grown to the whole: still one, not two.
    l.granted((WHOLE, WHOLE, 0), at(10_000), at(5000), at(5000));
    assert_eq!(l.decide(1, &[], at(5000)), Decision::Granted(0));
    assert!(matches!(l.decide(1, &[], at(5000)), Decision::Refused(_)));
    // Full at the whole (two requests, 50 tokens), granted half: the whole stays in
    // force, refilling at the whole rate, until the next report is sent.
    l.granted((WHOLE / 2, WHOLE / 2, 0), at(20_000), at(9000), at(9000));
    assert_eq!(l.fractions(at(9000)), (WHOLE, WHOLE));
    assert_eq!(l.report(at(9000), false).using, (WHOLE / 2, WHOLE / 2), "it reports what it shrinks to");
    assert_eq!(l.decide(1, &[], at(9000)), Decision::Granted(0));
    assert_eq!(l.decide(1, &[], at(9000)), Decision::Granted(0));
    assert_eq!(l.decide(1, &[], at(9100)), Decision::Granted(0), "a request in 100 ms at the whole rate");
    // Sent: half of the rate and the burst. The request bucket is spent, so no part of
    // the bursts was dropped over every limit.
    assert_eq!(l.shrink(at(9100)), 0);
    assert_eq!(l.fractions(at(9100)), (WHOLE / 2, WHOLE / 2));
    assert!(matches!(l.decide(1, &[], at(9200)), Decision::Refused(_)), "a request in 200 ms at half");
    assert_eq!(l.decide(1, &[], at(9300)), Decision::Granted(0));
    // Full again (one request, 25 tokens at half), grown to the whole and given back:
    // the tokens above half the bursts are dropped when the report is sent, and that
    // report gives them back (the least part over the limits), once.
    l.granted((WHOLE, WHOLE, 0), at(20_000), at(12_000), at(12_000));
    assert_eq!(l.decide(1, &[], at(14_000)), Decision::Granted(0));
    l.granted((WHOLE / 2, WHOLE / 2, 0), at(20_000), at(14_000), at(14_000));
    // Refilled at the whole rate until then: 2 requests and 50 tokens, half of each above
    // the smaller part. A report computed but not sent (not due) drops nothing.
    assert_eq!(l.report(at(15_000), false).using, (WHOLE / 2, WHOLE / 2));
    assert_eq!(l.fractions(at(15_000)), (WHOLE, WHOLE));
    assert_eq!(l.shrink(at(16_000)), WHOLE / 2);
    assert_eq!(l.shrink(at(16_000)), 0, "given back once");
    assert_eq!(l.decide(1, &[], at(16_000)), Decision::Granted(0));
    assert!(matches!(l.decide(1, &[], at(16_000)), Decision::Refused(_)));
}

#[test]
fn a_lease_refills_from_when_its_answer_came() {
    let l = leases();
    // Asked at 0, answered at 100 ms: the first request comes 200 ms after the answer.
    l.granted((WHOLE / 2, WHOLE / 2, 0), at(1000), at(100), at(0));
    assert!(matches!(l.decide(1, &[], at(0)), Decision::Refused(_)));
    assert!(matches!(l.decide(1, &[], at(200)), Decision::Refused(_)));
    assert_eq!(l.decide(1, &[], at(300)), Decision::Granted(0));
    // A failed refresh: no lease, and no call either for a refresh period.
    assert_eq!(l.decide(1, &[], at(1000)), Decision::NoLease);
    l.failed(at(1000));
    assert_eq!(l.decide(1, &[], at(1050)), Decision::Down);
    assert_eq!(l.decide(1, &[], at(1100)), Decision::NoLease);
}

#[test]
fn settles_charge_the_bucket_and_reports_say_what_is_used() {
    let l = leases();
    l.granted((WHOLE, WHOLE, 0), at(10_000), at(0), at(0));
    assert_eq!(l.fractions(at(0)).0, WHOLE);
    assert_eq!(l.decide(10, &[], at(1000)), Decision::Granted(0));
    // 50 tokens of burst: 40 left; a settle to 45 leaves 5.
    l.adjust(0, 0, 35);
    assert!(matches!(l.decide(10, &[], at(1000)), Decision::Refused(w) if w == Duration::from_millis(50)));
    // Asked for 40 tokens: refused, and the least part that holds it is reported.
    assert!(matches!(l.decide(40, &[], at(1000)), Decision::Refused(_)));
    let report = l.report(at(1000), false);
    assert_eq!((report.using, report.cap), ((WHOLE, WHOLE), WHOLE), "refused: it could use everything");
    assert_eq!(report.least, WHOLE * 4 / 5, "40 tokens of a burst of 50");
    assert_eq!(l.report(at(1000), false).cap, WHOLE, "not heard: reported again");
    l.reported(report.counts, at(1000));
    let idle = l.report(at(1000), false);
    assert_eq!(idle.cap, 0, "nothing asked since: idle");
    assert_eq!(idle.least, WHOLE * 4 / 5, "the last report's largest request still counts");
    l.reported(idle.counts, at(1000));
    assert_eq!(l.report(at(1000), false).least, WHOLE / 2, "then one request of the 2 a burst holds");
    // A benched member is skipped, with the bench as the wait.
    let bench = [at(1500).as_nanos()];
    assert!(matches!(l.decide(1, &bench, at(1100)), Decision::Refused(w) if w == Duration::from_millis(400)));
}

#[test]
fn a_refresh_is_due_when_the_period_ends_or_the_demand_moves() {
    use tower_limits_core::TenantKey;
    use tower_limits_core::fleet::TenantDemand;
    let l = leases();
    let tenant = |name: &str, bands: u64| TenantDemand {
        key: TenantKey::single(name).unwrap(),
        weight: 1,
        waiting: u64::from(bands != 0),
        outstanding: 1,
        bands,
    };
    let report = |cap: u64, held: u64, least: u64| Report { using: (held, WHOLE / 2), cap, least, counts: (0, 0, 0) };
    let first = [tenant("a", 1)];
    let full = report(WHOLE, WHOLE / 2, 1_000);
    let said = Sent::of(&first, &full);
    // Never heard: due at once.
    assert!(l.due(at(0), &said, &full));
    // Heard at 0 with a period of 400 ms (refresh periods are 100 ms): due from half
    // a refresh period before it ends, not earlier.
    l.heard(at(0), said.clone(), Some(Duration::from_millis(400)), None);
    assert!(!l.due(at(340), &said, &full));
    assert!(l.due(at(350), &said, &full));
    // Another tenant in the same band, or more of them waiting: not a move.
    let more = [tenant("a", 1), tenant("b", 1)];
    assert!(!l.due(at(100), &Sent::of(&more, &full), &full));
    // A band starting to wait, the replica going idle, no longer short, holding a
    // tenth more than it could use, or asked a request its burst part cannot hold
    // (larger than the last): each is.
    let batch = [tenant("a", 1), tenant("b", 2)];
    assert!(l.due(at(100), &Sent::of(&batch, &full), &full));
    assert!(l.due(at(100), &Sent::of(&[], &full), &full));
    let content = report(WHOLE / 2, WHOLE / 2, 1_000);
    assert!(l.due(at(100), &Sent::of(&first, &content), &content));
    // Below its part, wanting twice what it admitted: that swings around what it
    // holds from one period to the next, and is no move.
    l.heard(at(0), Sent::of(&first, &content), Some(Duration::from_millis(400)), None);
    let above = report(WHOLE / 2 + 3 * DEAD, WHOLE / 2, 1_000);
    assert!(!l.due(at(100), &Sent::of(&first, &above), &above));
    l.heard(at(0), said.clone(), Some(Duration::from_millis(400)), None);
    let spare = report(WHOLE / 4, WHOLE / 2, 1_000);
    assert!(l.due(at(100), &Sent::of(&first, &full), &spare));
    let cramped = report(WHOLE, WHOLE / 2, WHOLE);
    assert!(l.due(at(100), &Sent::of(&first, &cramped), &cramped));
    // An answer lost on its way back: due again after a refresh period.
    l.heard(at(0), said.clone(), None, None);
    assert!(l.due(at(50), &said, &full));
}

#[test]
fn a_limit_this_replica_lowers_holds_at_once_and_a_raise_waits_for_redis() {
    let l = leases();
    l.granted((WHOLE, WHOLE, 0), at(10_000), at(0), at(0));
    assert_eq!(l.fractions(at(0)), (WHOLE, WHOLE));
    // Full at 1 s: 2 requests and 50 tokens. The token limit lowered to 10 a second with a
    // burst of 5: the bucket keeps 5, and refills one token in 100 ms.
    l.lower(0, 1, (100_000_000, 500_000_000), at(1000));
    assert_eq!(l.decide(5, &[], at(1000)), Decision::Granted(0));
    assert!(matches!(l.decide(1, &[], at(1000)), Decision::Refused(w) if w == Duration::from_millis(100)));
    // A raise is not taken locally: the next refresh brings the fleet's limit.
    l.lower(0, 1, (10_000_000, 500_000_000), at(1000));
    assert!(matches!(l.decide(1, &[], at(1050)), Decision::Refused(_)));
    l.take_limits(&[(100_000_000, 200_000_000), (10_000_000, 500_000_000)], at(1050));
    assert_eq!(l.decide(1, &[], at(1100)), Decision::Granted(0), "at 100 a second");
}
