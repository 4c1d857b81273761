//! How account leases are refreshed: the settings a store is built with.

use std::time::Duration;

/// How account leases are refreshed: see
/// [`RedisAccountsBuilder::leases`](crate::RedisAccountsBuilder::leases).
///
/// ```
/// use std::time::Duration;
/// use tower_limits_redis::AccountLeases;
///
/// let leases = AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(Duration::from_millis(500));
/// assert_eq!(leases.refresh(), Duration::from_millis(50));
/// assert_eq!(leases.lasts(), Duration::from_millis(500));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct AccountLeases {
    refresh: Duration,
    lifetime: Duration,
    calm: Option<Duration>,
    largest_cost: u64,
}

impl Default for AccountLeases {
    fn default() -> Self {
        Self::new()
    }
}

impl AccountLeases {
    /// Refreshed every 100 ms, living 1 s.
    pub const fn new() -> AccountLeases {
        AccountLeases {
            refresh: Duration::from_millis(100),
            lifetime: Duration::from_secs(1),
            calm: None,
            largest_cost: u64::MAX,
        }
    }

    /// How often a replica with traffic renews its lease and reports its demand while
    /// capacity moves between replicas (default 100 ms): capacity moves within about
    /// three periods. A settled fleet refreshes less often
    /// ([`calm_every`](Self::calm_every)); a replica looks at its own demand every period
    /// either way, locally.
    pub const fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh = every;
        self
    }

    /// How long a lease lives without a refresh (default 1 s): how long a replica serves
    /// while Redis is away, and how long the fraction of a replica that died stays taken.
    /// At least two refresh periods plus the call timeout.
    pub const fn lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// The longest a replica goes between refreshes while the fleet is settled (default:
    /// four refresh periods, or less when the lifetime must cover two of them and the
    /// call timeout). Settled means that at its last refresh every live replica held
    /// what it was allotted: the period then doubles at each refresh up to this one, and
    /// falls back to the refresh period as soon as anything moves. A replica whose own
    /// demand moves (a band starts or stops waiting, it turns idle, busy or short of its
    /// part, or holds a tenth of the whole more than it could use) refreshes at its next
    /// refresh period however settled the fleet was; another replica's demand reaches it
    /// at its own next refresh, so capacity follows a replica's new demand within this
    /// period instead of within a refresh period. Must be at least the refresh period.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits_redis::AccountLeases;
    ///
    /// let leases = AccountLeases::new().calm_every(Duration::from_millis(300));
    /// assert_eq!(leases.calm(), Some(Duration::from_millis(300)));
    /// assert_eq!(AccountLeases::new().calm(), None);
    /// ```
    pub const fn calm_every(mut self, every: Duration) -> Self {
        self.calm = Some(every);
        self
    }

    /// The longest period between refreshes of a settled fleet, if set
    /// ([`calm_every`](Self::calm_every)); `None`: the default.
    #[must_use]
    pub const fn calm(&self) -> Option<Duration> {
        self.calm
    }

    /// The calm period in force with calls that may take `call`: the one set, or four
    /// refresh periods within half of what the lifetime leaves after a call (never below
    /// the refresh period).
    pub(crate) fn calm_in_force(&self, call: Duration) -> Duration {
        self.calm.unwrap_or_else(|| {
            let room = self.lifetime.saturating_sub(call) / 2;
            self.refresh.saturating_mul(4).min(room).max(self.refresh)
        })
    }

    /// The largest cost a request will have (default: no bound but the members' own
    /// bursts): a request costing more is refused at once as above capacity. A lease's
    /// part of the bursts is sized by the requests its replica was asked lately: a
    /// request larger than the part waits for the next refreshes to grow it.
    ///
    /// ```
    /// use tower_limits_redis::AccountLeases;
    ///
    /// assert_eq!(AccountLeases::new().largest(), u64::MAX);
    /// assert_eq!(AccountLeases::new().largest_cost(512).largest(), 512);
    /// ```
    pub const fn largest_cost(mut self, cost: u64) -> Self {
        self.largest_cost = cost;
        self
    }

    /// The largest cost a request may have.
    #[must_use]
    pub const fn largest(&self) -> u64 {
        self.largest_cost
    }

    /// The refresh period.
    #[must_use]
    pub const fn refresh(&self) -> Duration {
        self.refresh
    }

    /// How long a lease lives without a refresh.
    #[must_use]
    pub const fn lasts(&self) -> Duration {
        self.lifetime
    }
}
