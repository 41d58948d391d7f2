//! The relation cache: the latest Relation message per table OID, needed to interpret rows,
//! together with the change-stream relation (schema, name, row key) its row changes carry.

use std::collections::HashMap;

use super::message::{Relation, ReplicaIdentity};
use crate::change_stream;

/// A row change named a relation no Relation message has described in this session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected a Relation message for relation OID {oid} before its row changes, but none was received")]
pub struct UnknownRelation {
    pub oid: u32,
}

#[derive(Debug, Clone, Default)]
pub struct RelationCache {
    relations: HashMap<u32, CachedRelation>,
}

#[derive(Debug, Clone)]
pub(super) struct CachedRelation {
    pub(super) relation: Relation,
    /// Built once per Relation message and cloned into each row change.
    /// Shared by every row change of the relation (cloning it is a reference count).
    pub(super) stream_relation: std::sync::Arc<change_stream::Relation>,
    /// The column names, shared the same way by row changes that keep their text.
    pub(super) column_names: std::sync::Arc<[String]>,
}

/// The relation as row changes carry it: `rowKey` from the key-flagged columns and the replica
/// identity, plus the deprecated `keyColumns`/`replicaIdentity` pair and `relationOid`, as
/// Zero's Postgres source sends them (older subscribers need the deprecated pair).
fn stream_relation(relation: &Relation) -> change_stream::Relation {
    let columns = relation
        .columns
        .iter()
        .filter(|c| c.is_key())
        .map(|c| c.name.clone())
        .collect();
    let identity = match relation.replica_identity {
        ReplicaIdentity::Default => change_stream::ReplicaIdentity::Default,
        ReplicaIdentity::Nothing => change_stream::ReplicaIdentity::Nothing,
        ReplicaIdentity::Full => change_stream::ReplicaIdentity::Full,
        ReplicaIdentity::Index => change_stream::ReplicaIdentity::Index,
    };
    let row_key = change_stream::RowKey::new(columns, Some(identity));
    let mut out = change_stream::Relation::new(&relation.namespace, &relation.name, row_key)
        .with_legacy_key();
    out.extra.insert("relationOid".into(), relation.oid.into());
    out
}

impl RelationCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `relation`, replacing (and returning) the previous entry for its OID.
    pub fn insert(&mut self, relation: Relation) -> Option<Relation> {
        let entry = CachedRelation {
            stream_relation: std::sync::Arc::new(stream_relation(&relation)),
            column_names: relation.columns.iter().map(|c| c.name.clone()).collect(),
            relation,
        };
        self.relations
            .insert(entry.relation.oid, entry)
            .map(|previous| previous.relation)
    }

    pub fn get(&self, oid: u32) -> Result<&Relation, UnknownRelation> {
        self.entry(oid).map(|e| &e.relation)
    }

    /// The change-stream relation (schema, name, row key) for row changes of `oid`.
    pub fn stream_relation(&self, oid: u32) -> Result<&change_stream::Relation, UnknownRelation> {
        self.entry(oid).map(|e| &*e.stream_relation)
    }

    pub(super) fn entry(&self, oid: u32) -> Result<&CachedRelation, UnknownRelation> {
        self.relations.get(&oid).ok_or(UnknownRelation { oid })
    }

    pub fn len(&self) -> usize {
        self.relations.len()
    }

    pub fn is_empty(&self) -> bool {
        self.relations.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::{RelationColumn, ReplicaIdentity};

    fn relation(oid: u32, name: &str, columns: &[&str]) -> Relation {
        Relation {
            oid,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: ReplicaIdentity::Default,
            columns: columns
                .iter()
                .map(|c| RelationColumn {
                    flags: 0,
                    name: (*c).into(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    #[test]
    fn unknown_oid_is_a_typed_error() {
        let cache = RelationCache::new();
        let err = cache.get(16384).unwrap_err();
        assert_eq!(err, UnknownRelation { oid: 16384 });
        assert!(err.to_string().contains("16384"));
    }

    #[test]
    fn relation_messages_replace_entries_by_oid() {
        let mut cache = RelationCache::new();
        assert_eq!(cache.insert(relation(1, "a", &["x"])), None);
        assert_eq!(cache.insert(relation(2, "b", &["y"])), None);
        let previous = cache.insert(relation(1, "a", &["x", "z"])).unwrap();
        assert_eq!(previous.columns.len(), 1);
        assert_eq!(cache.get(1).unwrap().columns.len(), 2);
        assert_eq!(cache.get(2).unwrap().name, "b");
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.stream_relation(1).unwrap().name, "a");
    }

    #[test]
    fn stream_relation_takes_key_columns_from_flags_and_type_from_replica_identity() {
        let mut r = relation(16385, "users", &["org", "id", "name"]);
        r.columns[0].flags = 1;
        r.columns[1].flags = 1;
        r.replica_identity = ReplicaIdentity::Index;
        let mut cache = RelationCache::new();
        cache.insert(r);
        let s = cache.stream_relation(16385).unwrap();
        assert_eq!((s.schema.as_str(), s.name.as_str()), ("public", "users"));
        assert_eq!(s.row_key.columns, ["org", "id"]);
        assert_eq!(
            s.row_key.r#type,
            Some(change_stream::ReplicaIdentity::Index)
        );
        assert_eq!(
            s.key_columns.as_deref(),
            Some(&["org".to_owned(), "id".to_owned()][..])
        );
        assert_eq!(
            s.replica_identity,
            Some(change_stream::ReplicaIdentity::Index)
        );
        assert_eq!(s.extra.get("relationOid"), Some(&16385.into()));
        for (identity, expected) in [
            (
                ReplicaIdentity::Default,
                change_stream::ReplicaIdentity::Default,
            ),
            (
                ReplicaIdentity::Nothing,
                change_stream::ReplicaIdentity::Nothing,
            ),
            (ReplicaIdentity::Full, change_stream::ReplicaIdentity::Full),
        ] {
            let mut r = relation(7, "t", &["a"]);
            r.replica_identity = identity;
            cache.insert(r);
            assert_eq!(
                cache.stream_relation(7).unwrap().row_key.r#type,
                Some(expected)
            );
            assert!(cache.stream_relation(7).unwrap().row_key.columns.is_empty());
        }
    }
}
