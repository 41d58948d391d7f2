//! Capped exponential backoff with full jitter, seeded by the caller.
//!
//! After the `n`-th failure in a row the delay is drawn uniformly from `0..=min(max, initial·2ⁿ)`
//! ("full jitter"): clients that lost the same server at the same moment spread their
//! reconnects over the whole window instead of arriving together. A server-sent hint is a
//! floor on the drawn delay. The random source is a small seeded generator, so a given seed
//! replays the same delays in tests; hosts seed it from their own entropy.

/// The delay window of a [`Backoff`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// Upper bound of the window after the first failure.
    pub initial_ms: u64,
    /// The window never grows past this.
    pub max_ms: u64,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self {
            initial_ms: 500,
            max_ms: 30_000,
        }
    }
}

/// Failures in a row and the random stream that jitters their delays.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: BackoffPolicy,
    failures: u32,
    random: SplitMix64,
}

impl Backoff {
    pub fn new(policy: BackoffPolicy, seed: u64) -> Self {
        Self {
            policy,
            failures: 0,
            random: SplitMix64(seed),
        }
    }

    /// Failures since the last [`Backoff::reset`].
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The largest delay the next failure can draw.
    pub fn ceiling_ms(&self) -> u64 {
        let grown = self
            .policy
            .initial_ms
            .checked_shl(self.failures.min(63))
            .filter(|grown| grown >> self.failures.min(63) == self.policy.initial_ms)
            .unwrap_or(u64::MAX);
        grown.min(self.policy.max_ms)
    }

    /// Records a failure and draws its delay: uniform in `0..=ceiling`, at least `floor_ms`.
    pub fn next_delay_ms(&mut self, floor_ms: u64) -> u64 {
        let ceiling = self.ceiling_ms();
        let drawn = match ceiling.checked_add(1) {
            Some(span) => self.random.next() % span,
            None => self.random.next(),
        };
        self.failures = self.failures.saturating_add(1);
        drawn.max(floor_ms)
    }

    /// A connection proved healthy: the next failure starts from the initial window again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

/// SplitMix64: tiny, fast, and good enough to spread reconnects; not for secrets.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_window_doubles_from_the_initial_delay_up_to_the_cap() {
        let mut backoff = Backoff::new(BackoffPolicy::default(), 7);
        let mut ceilings = Vec::new();
        for _ in 0..9 {
            ceilings.push(backoff.ceiling_ms());
            backoff.next_delay_ms(0);
        }
        assert_eq!(
            ceilings,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
        );
        backoff.reset();
        assert_eq!((backoff.failures(), backoff.ceiling_ms()), (0, 500));
    }

    #[test]
    fn the_same_seed_replays_the_same_delays_and_others_differ() {
        let draw = |seed| {
            let mut backoff = Backoff::new(BackoffPolicy::default(), seed);
            (0..8).map(|_| backoff.next_delay_ms(0)).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn a_server_hint_is_a_floor() {
        let mut backoff = Backoff::new(BackoffPolicy::default(), 3);
        assert!(backoff.next_delay_ms(5_000) >= 5_000);
    }

    #[test]
    fn many_clients_spread_over_the_window() {
        // A reconnect storm: 1000 clients after the same failure land in every tenth.
        let mut buckets = [0u32; 10];
        for seed in 0..1000 {
            let mut backoff = Backoff::new(BackoffPolicy::default(), seed);
            backoff.next_delay_ms(0);
            let delay = backoff.next_delay_ms(0);
            buckets[(delay * 10 / 1001) as usize] += 1;
        }
        assert!(buckets.iter().all(|&count| count > 50), "{buckets:?}");
    }

    proptest! {
        #[test]
        fn delays_stay_within_the_window_and_above_the_floor(
            seed in any::<u64>(),
            initial in 1u64..5_000,
            extra in 0u64..100_000,
            floor in prop::option::of(0u64..60_000),
            steps in 1usize..80,
        ) {
            let policy = BackoffPolicy { initial_ms: initial, max_ms: initial + extra };
            let mut backoff = Backoff::new(policy, seed);
            for step in 0..steps {
                let ceiling = backoff.ceiling_ms();
                prop_assert!(ceiling <= policy.max_ms);
                prop_assert!(ceiling >= policy.initial_ms.min(policy.max_ms));
                let expected = policy.initial_ms.saturating_mul(1u64 << step.min(62)).min(policy.max_ms);
                prop_assert_eq!(ceiling, expected);
                let delay = backoff.next_delay_ms(floor.unwrap_or(0));
                prop_assert!(delay <= ceiling.max(floor.unwrap_or(0)));
                prop_assert!(delay >= floor.unwrap_or(0));
            }
        }
    }
}
