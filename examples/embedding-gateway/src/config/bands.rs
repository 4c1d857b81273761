//! Priority bands of the fair queue: `gateway.bands`, `gateway.band_header` and each
//! tenant's `band`.

use http::HeaderName;
use tower_limits::core::fair_queue::BandConfig;

use super::raw::{RawGateway, S};
use super::{ConfigError, Source};

/// `gateway.bands` (first goes first) and `gateway.band_header`, checked.
pub(super) fn bands(src: &Source<'_>, g: &RawGateway) -> Result<(Vec<BandConfig>, Option<HeaderName>), ConfigError> {
    let mut bands: Vec<BandConfig> = Vec::new();
    let mut total = 0;
    if let Some(raw) = &g.bands {
        if raw.get_ref().is_empty() {
            return Err(src.at(raw, "gateway.bands", "name at least one band, or leave the field out"));
        }
        if raw.get_ref().len() > tower_limits::core::fair_queue::MAX_BANDS {
            let most = tower_limits::core::fair_queue::MAX_BANDS;
            return Err(src.at(raw, "gateway.bands", format!("at most {most} bands")));
        }
        for (i, band) in raw.get_ref().iter().enumerate() {
            let name = band.name.get_ref();
            if name.is_empty() {
                return Err(src.at(&band.name, format!("gateway.bands[{i}].name"), "must not be empty"));
            }
            if bands.iter().any(|b| &b.name == name) {
                return Err(src.at(&band.name, format!("gateway.bands[{i}].name"), format!("{name:?} is named twice")));
            }
            let share = match &band.min_share_percent {
                Some(v) => {
                    total += v.get_ref();
                    if total > 100 {
                        return Err(src.at(
                            v,
                            format!("gateway.bands[{i}].min_share_percent"),
                            format!("the bands' minimum shares sum to {total}%, above 100%"),
                        ));
                    }
                    *v.get_ref() as u32
                }
                None => 0,
            };
            bands.push(BandConfig::new(name.clone(), share));
        }
    }
    let header = match &g.band_header {
        None => None,
        Some(v) if bands.is_empty() => {
            return Err(src.at(v, "gateway.band_header", "needs gateway.bands: there is no band to choose"));
        }
        Some(v) => match HeaderName::from_bytes(v.get_ref().as_bytes()) {
            Ok(name) => Some(name),
            Err(_) => return Err(src.at(v, "gateway.band_header", format!("{:?} is not a header name", v.get_ref()))),
        },
    };
    Ok((bands, header))
}

/// The band of tenant `base` (`tenant[i]`): its `band`, or the first.
pub(super) fn tenant_band(
    src: &Source<'_>,
    band: Option<&S<String>>,
    base: &str,
    bands: &[BandConfig],
) -> Result<usize, ConfigError> {
    let Some(v) = band else { return Ok(0) };
    bands.iter().position(|b| &b.name == v.get_ref()).ok_or_else(|| {
        let known: Vec<&str> = bands.iter().map(|b| b.name.as_str()).collect();
        let message = if known.is_empty() {
            format!("no band is named {:?}: gateway.bands names none", v.get_ref())
        } else {
            format!("no band is named {:?} (bands: {})", v.get_ref(), known.join(", "))
        };
        src.at(v, format!("{base}.band"), message)
    })
}
