//! Budgets in money: each model's `[price.MODEL]`, a plan tier's `budget` and
//! `gateway.timezone`.
//!
//! A request's price is counted in micro-units of the currency (a millionth of a dollar),
//! from the model's prices per million input and output tokens; a budget is a calendar
//! window of such micro-units per tier key. Every price and budget is in one currency.

use std::collections::{BTreeMap, HashMap};

use tower_limits::LimitPolicy;
use tower_limits::LimitSetPolicy;
use tower_limits::core::algorithm::{CalendarPeriod, CalendarWindow};

use super::raw::{RawPrice, RawTierLimits, S};
use super::{ConfigError, Source};

/// What a model costs, in billionths of the currency per token (a price per million
/// tokens of 0.15 is 150).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPrice {
    /// Per input (prompt) token.
    pub input_nanos: u64,
    /// Per output (completion) token.
    pub output_nanos: u64,
}

impl ModelPrice {
    /// The price of `input` and `output` tokens in micro-units, rounded up.
    ///
    /// ```
    /// use embedding_gateway::config::ModelPrice;
    ///
    /// // 0.15 and 0.60 a million tokens: 1,000 in and 500 out cost 450 micro-units.
    /// let price = ModelPrice { input_nanos: 150, output_nanos: 600 };
    /// assert_eq!(price.micros(1_000, 500), 450);
    /// assert_eq!(price.micros(1, 0), 1); // rounded up: never free
    /// ```
    #[must_use]
    pub fn micros(&self, input: u64, output: u64) -> u64 {
        let nanos =
            u128::from(input) * u128::from(self.input_nanos) + u128::from(output) * u128::from(self.output_nanos);
        u64::try_from(nanos.div_ceil(1000)).unwrap_or(u64::MAX)
    }
}

/// One budget of a plan, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// The tier whose keys each have it.
    pub tier: String,
    /// The amount per period, in micro-units.
    pub micros: u64,
    /// The calendar period.
    pub period: CalendarPeriod,
}

/// The budgets of every plan, the prices they count and the time zone of their periods.
#[derive(Debug, Clone)]
pub struct Budgets {
    /// The one currency of every price and budget (`"USD"`).
    pub currency: String,
    /// The time zone whose midnights start the periods (`gateway.timezone`, `"UTC"` when
    /// left out).
    pub timezone: String,
    /// Each served model's price.
    pub prices: HashMap<String, ModelPrice>,
    /// Each plan's budgets (by the plan's index), and the limit set holding them: one
    /// calendar window per budget, named `TIER.budget`, counting the price.
    pub plans: Vec<(Vec<Budget>, Option<LimitSetPolicy>)>,
}

impl Budgets {
    /// The amount `micros` as a decimal number of the currency: `"12.5 USD"`.
    #[must_use]
    pub fn money(&self, micros: u64) -> String {
        let (whole, frac) = (micros / 1_000_000, micros % 1_000_000);
        if frac == 0 {
            return format!("{whole} {}", self.currency);
        }
        let frac = format!("{frac:06}");
        format!("{whole}.{} {}", frac.trim_end_matches('0'), self.currency)
    }
}

/// Parses `"100 USD / month"`: the amount in micro-units, the currency and the period.
fn parse_budget(text: &str) -> Result<(u64, String, CalendarPeriod), String> {
    let expected = "expected an amount, a currency and a calendar period, such as \"100 USD / month\"";
    let (money, period) = text.split_once('/').ok_or_else(|| format!("{expected}, got {text:?}"))?;
    let mut words = money.split_whitespace();
    let (Some(amount), Some(currency), None) = (words.next(), words.next(), words.next()) else {
        return Err(format!("{expected}, got {text:?}"));
    };
    let period: CalendarPeriod = period.trim().parse()?;
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(format!("{currency:?} is not a currency code such as \"USD\" or \"EUR\""));
    }
    let micros = decimal_micros(amount)
        .ok_or_else(|| format!("{amount:?} is not an amount such as \"100\" or \"12.50\" (at most six decimals)"))?;
    if micros == 0 {
        return Err("a budget of zero admits nothing: give an amount above zero, or leave the budget out".into());
    }
    Ok((micros, currency.to_owned(), period))
}

/// `"12.5"` as 12,500,000 micro-units; `None` for anything but a plain decimal of at most
/// six decimals below 2^53 micro-units.
fn decimal_micros(text: &str) -> Option<u64> {
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    if !digits(whole) || (!frac.is_empty() && !digits(frac)) || frac.len() > 6 {
        return None;
    }
    let whole: u64 = whole.replace('_', "").parse().ok()?;
    let frac: u64 = if frac.is_empty() { 0 } else { format!("{frac:0<6}").parse().ok()? };
    let micros = whole.checked_mul(1_000_000)?.checked_add(frac)?;
    (micros < 1 << 53).then_some(micros)
}

/// A price per million tokens as billionths per token.
fn price_nanos(src: &Source<'_>, value: &S<f64>, field: &str) -> Result<u64, ConfigError> {
    let v = *value.get_ref();
    if !v.is_finite() || !(0.0..=1e9).contains(&v) {
        return Err(src.at(value, field, "must be a price per million tokens, at least 0"));
    }
    let nanos = (v * 1000.0).round();
    if v > 0.0 && nanos == 0.0 {
        return Err(src.at(value, field, "is below 0.001 per million tokens, the smallest price counted"));
    }
    Ok(nanos as u64)
}

/// `[price.MODEL]`, every plan tier's `budget` and `gateway.timezone`; `None` when no plan
/// has a budget (prices alone change nothing).
pub(super) fn budgets(
    src: &Source<'_>,
    prices: &BTreeMap<String, S<RawPrice>>,
    plans: &BTreeMap<String, BTreeMap<String, S<RawTierLimits>>>,
    timezone: Option<&S<String>>,
    tiers: &[String],
    models: &[String],
) -> Result<Option<Budgets>, ConfigError> {
    let zone = match timezone {
        Some(z) => {
            CalendarWindow::new(1, CalendarPeriod::Day, z.get_ref())
                .map_err(|e| src.at(z, "gateway.timezone", e.message()))?;
            z.get_ref().clone()
        }
        None => "UTC".to_owned(),
    };
    // The currency of the first price, which every other price and budget must share.
    let mut currency: Option<(String, String)> = None;
    let mut same_currency = |code: &str, field: &str| -> Result<(), String> {
        match &currency {
            Some((c, first)) if c != code => {
                Err(format!("{code:?} is not {c:?}, the currency of {first}: prices and budgets share one currency"))
            }
            Some(_) => Ok(()),
            None => {
                currency = Some((code.to_owned(), field.to_owned()));
                Ok(())
            }
        }
    };
    let mut by_model = HashMap::new();
    for (model, p) in prices {
        let base = format!("price.{model}");
        let c = &p.get_ref().currency;
        if c.get_ref().len() != 3 || !c.get_ref().bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(src.at(c, format!("{base}.currency"), "must be a currency code such as \"USD\" or \"EUR\""));
        }
        let field = format!("{base}.currency");
        same_currency(c.get_ref(), &field).map_err(|e| src.at(c, &field, e))?;
        let input_nanos = price_nanos(src, &p.get_ref().input, &format!("{base}.input"))?;
        let output_nanos = match &p.get_ref().output {
            Some(o) => price_nanos(src, o, &format!("{base}.output"))?,
            None => 0,
        };
        by_model.insert(model.clone(), ModelPrice { input_nanos, output_nanos });
    }
    let mut any = None;
    let mut out = Vec::new();
    for (name, by_tier) in plans {
        let mut budgets = Vec::new();
        let mut policy = LimitSetPolicy::new().tiers(tiers.iter().cloned());
        for (tier, limits) in by_tier {
            let Some(raw) = &limits.get_ref().budget else { continue };
            let field = format!("plan.{name}.{tier}.budget");
            let (micros, code, period) = parse_budget(raw.get_ref()).map_err(|e| src.at(raw, &field, e))?;
            if prices.is_empty() {
                let message =
                    format!("a budget in {code} needs the models' prices ([price.MODEL], currency = {code:?})");
                return Err(src.at(raw, &field, message));
            }
            same_currency(&code, &field).map_err(|e| src.at(raw, &field, e))?;
            any.get_or_insert((field, raw.span()));
            policy = policy.limit(
                LimitPolicy::calendar_window(format!("{tier}.budget"), micros, period, zone.clone())
                    .per(tier.as_str())
                    .counting_cost(),
            );
            budgets.push(Budget { tier: tier.clone(), micros, period });
        }
        let policy = (!budgets.is_empty()).then_some(policy);
        out.push((budgets, policy));
    }
    let Some((first, span)) = any else { return Ok(None) };
    // Every served model needs a price once a budget counts money.
    if let Some(model) = models.iter().find(|m| !by_model.contains_key(*m)) {
        return Err(src.error(
            Some(span),
            format!("price.{model}"),
            format!("the model {model:?} has no price, and {first} counts every request's price: give it one"),
        ));
    }
    let currency = currency.map(|c| c.0).unwrap_or_default();
    Ok(Some(Budgets { currency, timezone: zone, prices: by_model, plans: out }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_with_their_errors() {
        assert_eq!(parse_budget("100 USD / month"), Ok((100_000_000, "USD".into(), CalendarPeriod::Month)));
        assert_eq!(parse_budget("12.5 EUR/day"), Ok((12_500_000, "EUR".into(), CalendarPeriod::Day)));
        assert_eq!(parse_budget("0.000001 USD / week").map(|b| b.0), Ok(1));
        assert!(parse_budget("0 USD / month").unwrap_err().contains("zero admits nothing"));
        assert!(parse_budget("100 usd / month").unwrap_err().contains("currency code"));
        assert!(parse_budget("100 USD / fortnight").unwrap_err().contains("day, week, month or year"));
        assert!(parse_budget("100 USD").unwrap_err().contains("such as \"100 USD / month\""));
        assert!(parse_budget("1.0000001 USD / day").unwrap_err().contains("six decimals"));
        assert!(parse_budget("-1 USD / day").is_err());
    }
}
