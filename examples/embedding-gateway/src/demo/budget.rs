//! `demo --budget`: a team's monthly budget in money spent, refused and renewed, on
//! tokio's paused clock (a month passes in well under a second).
//!
//! The first demo client whose plan has a budget sends a chat completion every ten
//! minutes from midnight of the next month's first day, in the budgets' time zone, until
//! its team's budget refuses one; the clock then jumps to a millisecond before the
//! renewal the refusal names, and to the renewal itself. So that a few dozen requests
//! spend it, the demo scales the budget down to [`DEMO_BUDGET_MICROS`] (the configured
//! amount is printed beside it).
//!
//! It passes when the answers' usage, priced, never exceeds the budget; when the budget
//! counted exactly that (every estimate settled to the usage); when the refusal waits
//! exactly until the first instant of the following month in the zone, computed here
//! from the calendar; and when a request a millisecond before that is refused and one at
//! it is served.

use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use jiff::ToSpan;
use jiff::tz::TimeZone;
use tower::{BoxError, ServiceExt};

use crate::config::{Config, KeyDigest};
use crate::gateway::{Gateway, in_process};

/// The budget the demo gives the team: two thousandths of a currency unit, which a few
/// hundred short chat completions spend.
pub const DEMO_BUDGET_MICROS: u64 = 2_000;

/// How far apart the team's requests are.
const EVERY: Duration = Duration::from_secs(600);

/// The most requests the demo sends before giving up on a refusal.
const MOST_REQUESTS: usize = 5_000;

/// What the scenario saw.
#[derive(Debug)]
pub struct BudgetRun {
    /// Requests served before the refusal.
    pub served: usize,
    /// What the answers' usage costs, priced, in micro-units.
    pub billed: u64,
    /// What the budget counted as spent when it refused.
    pub counted: u64,
    /// The budget, in micro-units.
    pub budget: u64,
    /// Whether the refusal waited exactly until the next period.
    pub renews_on_time: bool,
    /// Whether a request a millisecond before the renewal was refused and one at it served.
    pub renewed: bool,
}

impl BudgetRun {
    /// Whether every check held.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.served > 0
            && self.billed <= self.budget
            && self.counted == self.billed
            && self.renews_on_time
            && self.renewed
    }
}

/// Runs the scenario on a paused clock of its own.
///
/// # Errors
/// A configuration without budgets, or a gateway that cannot be built.
pub fn run(config: &Config) -> Result<bool, BoxError> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?;
    let run = runtime.block_on(scenario(config.clone()))?;
    Ok(run.passed())
}

/// The wall-clock time on the gateway's clock (the layers' clock counts from the library's
/// origin, whose wall time it knows).
fn wall_now() -> jiff::Timestamp {
    let origin = tokio::time::Instant::from_std(tower_limits::core::time::origin());
    let since = tokio::time::Instant::now().saturating_duration_since(origin);
    let unix = tower_limits::core::time::unix_origin() + since;
    jiff::Timestamp::try_from(unix).unwrap_or(jiff::Timestamp::UNIX_EPOCH)
}

/// The first instant of the month after the one holding `t`, in `zone`.
fn next_month(t: jiff::Timestamp, zone: &TimeZone) -> Result<jiff::Timestamp, BoxError> {
    let first = t.to_zoned(zone.clone()).date().first_of_month().checked_add(1.month())?;
    Ok(first.to_zoned(zone.clone())?.timestamp())
}

fn until(t: jiff::Timestamp) -> Duration {
    let nanos = t.as_nanosecond() - wall_now().as_nanosecond();
    Duration::from_nanos(u64::try_from(nanos.max(0)).unwrap_or(u64::MAX))
}

#[allow(clippy::print_stdout)]
async fn scenario(mut config: Config) -> Result<BudgetRun, BoxError> {
    let budgets =
        config.budgets.clone().ok_or("demo --budget needs a configuration with budgets (plan.NAME.TIER.budget)")?;
    // The first demo client whose plan has a budget, its tenant key and its first budget.
    let (client, plan, tenant_key, budget) = config
        .demo
        .clients
        .iter()
        .find_map(|c| {
            let digest = KeyDigest::of(&c.key);
            let (tenant, key) =
                config.tenants.iter().find_map(|t| Some((t, t.keys.iter().find(|k| k.digest == digest)?)))?;
            let first = budgets.plans.get(tenant.plan)?.0.first()?;
            Some((c.key.clone(), tenant.plan, key.tenant_key.clone(), first.clone()))
        })
        .ok_or("demo --budget needs a demo client on a plan with a budget")?;
    let model = config.gateway.chat_models.first().cloned().ok_or("demo --budget needs a chat model")?;
    let price = *budgets.prices.get(&model).ok_or("the chat model has no price")?;
    // The demo's amount, in the plan's budget policy and in the description.
    let limit_name = format!("{}.budget", budget.tier);
    if let Some(b) = config.budgets.as_mut() {
        if let Some(policy) = b.plans.get_mut(plan).and_then(|p| p.1.as_mut()) {
            for l in policy.limits.iter_mut().filter(|l| l.name == limit_name) {
                l.limit = Some(DEMO_BUDGET_MICROS);
            }
        }
    }
    let (router, _) = crate::upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router))?;
    let zone = TimeZone::get(&budgets.timezone)?;
    let money = |m: u64| budgets.money(m);
    let when = |t: jiff::Timestamp| t.to_zoned(zone.clone()).strftime("%Y-%m-%d %H:%M %Z").to_string();
    println!(
        "budget: {} of {} a {}, scaled down to {} for the demo (periods in {}); {model} at {} in and {} out per \
         million tokens",
        limit_name,
        money(budget.micros),
        budget.period,
        money(DEMO_BUDGET_MICROS),
        budgets.timezone,
        money(price.input_nanos * 1000),
        money(price.output_nanos * 1000),
    );

    // From the next month's first instant: nothing spent, a whole month ahead.
    let start = next_month(wall_now(), &zone)?;
    tokio::time::advance(until(start)).await;
    let chat = || {
        let body = serde_json::json!({
            "model": model,
            "messages": [{ "role": "user", "content": "Summarise the quarterly report in three sentences." }],
            "max_tokens": 300,
        });
        Request::post(crate::gateway::CHAT_PATH)
            .header("authorization", format!("Bearer {client}"))
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
    };
    let (mut served, mut billed) = (0usize, 0u64);
    let refusal = loop {
        let answer = gateway.router.clone().oneshot(chat()?).await?;
        let status = answer.status();
        let headers = answer.headers().clone();
        let body: serde_json::Value = serde_json::from_slice(&answer.into_body().collect().await?.to_bytes())?;
        if status == StatusCode::OK {
            let prompt = body["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            let completion = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            billed += price.micros(prompt, completion);
            served += 1;
        } else if body["error"]["code"] == "budget_exceeded" {
            break Some((headers, body));
        } else {
            return Err(format!("the team's request was answered {status}: {body}").into());
        }
        if served >= MOST_REQUESTS {
            break None;
        }
        tokio::time::advance(EVERY).await;
    };
    let Some((headers, body)) = refusal else {
        return Err(format!("{MOST_REQUESTS} requests and the budget never refused").into());
    };
    let refused_at = wall_now();
    let left = gateway.budget_remaining(plan, &tenant_key, &limit_name).map_or(0, |l| l.0);
    let counted = DEMO_BUDGET_MICROS - left;
    let wait_ms: u64 = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .ok_or("the refusal has no retry-after-ms")?;
    let renewal = next_month(refused_at, &zone)?;
    let expected = until(renewal);
    // retry-after-ms rounds the exact wait up to the millisecond.
    let renews_on_time = Duration::from_millis(wait_ms) >= expected
        && Duration::from_millis(wait_ms) < expected + Duration::from_millis(1);
    println!(
        "  from {}, a chat completion every {} minutes: {served} served, their usage priced {} ({} counted by the budget)",
        when(start),
        EVERY.as_secs() / 60,
        money(billed),
        money(counted),
    );
    println!("  refused at {}: 429 {}", when(refused_at), body["error"]["message"].as_str().unwrap_or_default());
    tokio::time::advance(expected - Duration::from_millis(1)).await;
    let before = gateway.router.clone().oneshot(chat()?).await?.status();
    tokio::time::advance(Duration::from_millis(1)).await;
    let at = gateway.router.clone().oneshot(chat()?).await?.status();
    let renewed = before == StatusCode::TOO_MANY_REQUESTS && at == StatusCode::OK;
    println!(
        "  renewal at {}: a millisecond before, {}; at the instant, {}",
        when(renewal),
        before.as_u16(),
        at.as_u16()
    );
    let run = BudgetRun { served, billed, counted, budget: DEMO_BUDGET_MICROS, renews_on_time, renewed };
    let verdict = if run.passed() { "PASS" } else { "FAIL" };
    println!(
        "  {verdict}: spent {} of {} (never above), the budget counted {} the answers' cost, the wait {} the \
         renewal, renewed {}",
        money(billed),
        money(DEMO_BUDGET_MICROS),
        if counted == billed { "exactly" } else { "NOT" },
        if renews_on_time { "ended on" } else { "did NOT end on" },
        if renewed { "on the instant" } else { "NOT on the instant" },
    );
    Ok(run)
}
