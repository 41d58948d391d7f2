//! Which scope-sync mutations a stored commit confirms.
//!
//! The session reports [`Effect::Confirmed`](super::Effect::Confirmed) while it hands on the
//! upstream transaction that applied a client's mutation; the client may only hear of it once
//! that transaction's commit is stored (`docs/protocol/scope-sync.md`, "Writes"). Between the
//! two, a transaction can be rolled back (its mutations are then not confirmed: the client's
//! retry is) or sent again from its beginning after a restart (its mutations come again).

use crate::watermark::Watermark;

/// Mutations confirmed by transactions handed on and not stored yet.
#[derive(Debug, Clone, Default)]
pub struct MutationConfirms {
    /// The commit watermark of the transaction handed on last (its `begin`).
    handed_on: Option<Watermark>,
    /// `(commit watermark, client id, mutation id)`, in the order confirmed.
    pending: Vec<(Watermark, String, u64)>,
}

impl MutationConfirms {
    /// The `begin` of the transaction that commits at `watermark` was handed on. One sent again
    /// from its beginning confirms its mutations again, so those recorded for it go.
    pub fn begin(&mut self, watermark: &Watermark) {
        self.pending.retain(|(at, _, _)| at != watermark);
        self.handed_on = Some(watermark.clone());
    }

    /// The transaction handed on last applied `client_id`'s mutation `mutation_id`. Nothing is
    /// recorded before a first `begin`.
    pub fn confirmed(&mut self, client_id: String, mutation_id: u64) {
        if let Some(watermark) = &self.handed_on {
            self.pending
                .push((watermark.clone(), client_id, mutation_id));
        }
    }

    /// The commit at `watermark` is being stored: the mutations it confirms, in the order
    /// confirmed. Those of transactions before it were rolled back (never committed) and go.
    pub fn take(&mut self, watermark: &Watermark) -> Vec<(String, u64)> {
        let mut taken = Vec::new();
        self.pending.retain(|(at, client_id, mutation_id)| {
            if at == watermark {
                taken.push((client_id.clone(), *mutation_id));
            }
            at > watermark
        });
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watermark::Lsn;

    fn w(n: u64) -> Watermark {
        Lsn(n).to_watermark()
    }

    #[test]
    fn a_commit_takes_the_mutations_its_transaction_confirmed() {
        let mut confirms = MutationConfirms::default();
        confirms.begin(&w(10));
        confirms.confirmed("c1".into(), 1);
        confirms.confirmed("c2".into(), 7);
        confirms.begin(&w(11));
        confirms.confirmed("c1".into(), 2);
        assert_eq!(
            confirms.take(&w(10)),
            vec![("c1".to_owned(), 1), ("c2".to_owned(), 7)]
        );
        assert_eq!(confirms.take(&w(11)), vec![("c1".to_owned(), 2)]);
        assert!(confirms.take(&w(11)).is_empty());
    }

    #[test]
    fn nothing_is_recorded_before_a_first_begin() {
        let mut confirms = MutationConfirms::default();
        confirms.confirmed("c1".into(), 1);
        confirms.begin(&w(10));
        confirms.confirmed("c2".into(), 2);
        assert_eq!(confirms.take(&w(10)), vec![("c2".to_owned(), 2)]);
    }

    #[test]
    fn a_transaction_sent_again_confirms_its_mutations_once() {
        let mut confirms = MutationConfirms::default();
        confirms.begin(&w(10));
        confirms.confirmed("c1".into(), 1);
        // A restart: Postgres sends the transaction again from its beginning.
        confirms.begin(&w(10));
        confirms.confirmed("c1".into(), 1);
        assert_eq!(confirms.take(&w(10)), vec![("c1".to_owned(), 1)]);
    }

    #[test]
    fn mutations_of_a_transaction_never_committed_are_dropped() {
        let mut confirms = MutationConfirms::default();
        confirms.begin(&w(10));
        confirms.confirmed("c1".into(), 1);
        // Rolled back: the next commit stored is a later transaction's.
        confirms.begin(&w(11));
        confirms.confirmed("c2".into(), 5);
        assert_eq!(confirms.take(&w(11)), vec![("c2".to_owned(), 5)]);
        assert!(confirms.take(&w(10)).is_empty());
    }
}
