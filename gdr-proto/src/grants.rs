//! Grants, both ways: the ones this side made to a peer ([`LocalGrants`],
//! with the revocation fence) and the ones a peer announced to this side
//! ([`RemoteGrants`], bounded).
//!
//! # The revocation fence
//!
//! Once a grant's revoke has completed, no byte moves under it by any
//! path, requests already accepted included. A path that moves bytes
//! through this side's own hands (the staged path's copies between a
//! landing slot and the granted GPU memory) takes a *use* of the grant
//! for each operation ([`LocalGrants::begin_use`], checked against the
//! grant's rights and range each time) and ends it when the operation has
//! ended ([`LocalGrants::end_use`]). [`LocalGrants::revoke`] refuses every
//! later use at once; the grant is *fenced* when its last use has ended
//! ([`LocalGrants::is_fenced`]), and only then does its payload (what the
//! driver keeps of it: its region, its memory registrations) come back to
//! be dropped. A path whose bytes the NIC moves against an MR needs no
//! uses: deregistering the grant's MR is the fence there, since the NIC
//! refuses the rkey once `ibv_dereg_mr` has returned.

use std::collections::HashMap;

use crate::PeerMisbehaved;

/// A grant's id: unique per granting engine, never reused.
pub type GrantId = u64;

/// What a request does to granted memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// The peer reads it.
    Read,
    /// The peer writes it.
    Write,
}

impl Access {
    /// The verb, for messages.
    pub fn verb(self) -> &'static str {
        match self {
            Self::Read => "READ",
            Self::Write => "WRITE",
        }
    }
}

/// What a grant allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rights {
    /// READ only.
    Read,
    /// WRITE only.
    Write,
    /// Both.
    ReadWrite,
}

impl Rights {
    /// Whether `access` is allowed.
    pub fn allows(self, access: Access) -> bool {
        matches!(
            (self, access),
            (Self::ReadWrite, _) | (Self::Read, Access::Read) | (Self::Write, Access::Write)
        )
    }
}

/// The range and rights a grant gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    /// Bytes granted (offsets are from the grant's first byte).
    pub len: u64,
    /// What the peer may do with them.
    pub rights: Rights,
}

/// Why a request under a grant is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No such grant here: never made, or revoked.
    #[error("grant {0:#x} is not live")]
    NotGranted(GrantId),
    /// The grant does not allow the access.
    #[error("grant {grant:#x} does not allow {}", access.verb())]
    AccessDenied {
        /// The grant.
        grant: GrantId,
        /// What was asked.
        access: Access,
    },
    /// The range runs past the grant (or is empty).
    #[error("{len} bytes at offset {offset} are not inside grant {grant:#x} of {size} bytes")]
    OutOfBounds {
        /// The grant.
        grant: GrantId,
        /// The range's start.
        offset: u64,
        /// Its length.
        len: u64,
        /// The grant's length.
        size: u64,
    },
}

/// What [`LocalGrants::revoke`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Revoked<T> {
    /// No live grant of that id (never made, or revoked already).
    Unknown,
    /// No use was in flight: the grant is gone and fenced now; its payload
    /// is the caller's to drop.
    Fenced(T),
    /// Uses are still in flight: none may begin any more, and the payload
    /// comes back from the [`LocalGrants::end_use`] that ends the last one.
    Draining {
        /// Uses in flight.
        uses: u32,
    },
}

#[derive(Debug)]
struct Local<T> {
    terms: Terms,
    live: bool,
    uses: u32,
    payload: T,
}

/// The grants this side made to one peer, with payload `T` (what the
/// driver keeps of each), and the fence of each revoke (module docs).
#[derive(Debug)]
pub struct LocalGrants<T> {
    grants: HashMap<GrantId, Local<T>>,
}

impl<T> Default for LocalGrants<T> {
    fn default() -> Self {
        Self {
            grants: HashMap::new(),
        }
    }
}

impl<T> LocalGrants<T> {
    /// Records a new live grant. Ids are the granting engine's, never
    /// reused: `false` (nothing changed) if `id` is here already.
    pub fn insert(&mut self, id: GrantId, terms: Terms, payload: T) -> bool {
        if self.grants.contains_key(&id) {
            return false;
        }
        self.grants.insert(
            id,
            Local {
                terms,
                live: true,
                uses: 0,
                payload,
            },
        );
        true
    }

    /// The payload of live grant `id`.
    pub fn get(&self, id: GrantId) -> Option<&T> {
        self.grants.get(&id).filter(|g| g.live).map(|g| &g.payload)
    }

    /// The terms of live grant `id`.
    pub fn terms(&self, id: GrantId) -> Option<Terms> {
        self.grants.get(&id).filter(|g| g.live).map(|g| g.terms)
    }

    /// Whether grant `id` is live (made and not revoked).
    pub fn is_live(&self, id: GrantId) -> bool {
        self.get(id).is_some()
    }

    /// Checks `access` to `len` bytes at `offset` of grant `id` without
    /// taking a use; its payload if allowed.
    pub fn check(&self, id: GrantId, access: Access, offset: u64, len: u64) -> Result<&T, Refusal> {
        let grant = self
            .grants
            .get(&id)
            .filter(|g| g.live)
            .ok_or(Refusal::NotGranted(id))?;
        if !grant.terms.rights.allows(access) {
            return Err(Refusal::AccessDenied { grant: id, access });
        }
        let size = grant.terms.len;
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Refusal::OutOfBounds {
                grant: id,
                offset,
                len,
                size,
            });
        }
        Ok(&grant.payload)
    }

    /// [`LocalGrants::check`], then takes a use of the grant: it is not
    /// fenced until the matching [`LocalGrants::end_use`].
    pub fn begin_use(
        &mut self,
        id: GrantId,
        access: Access,
        offset: u64,
        len: u64,
    ) -> Result<&T, Refusal> {
        self.check(id, access, offset, len)?;
        let grant = self.grants.get_mut(&id).expect("checked");
        grant.uses += 1;
        Ok(&grant.payload)
    }

    /// Ends a use of grant `id` taken by [`LocalGrants::begin_use`]. When
    /// it was the last use of a revoked grant, the grant is fenced now and
    /// its payload is returned for the caller to drop.
    pub fn end_use(&mut self, id: GrantId) -> Option<T> {
        let grant = self.grants.get_mut(&id)?;
        grant.uses = grant.uses.saturating_sub(1);
        if grant.live || grant.uses > 0 {
            return None;
        }
        self.grants.remove(&id).map(|g| g.payload)
    }

    /// Revokes grant `id`: no use may begin from now on (see [`Revoked`]
    /// for what happens to the ones in flight).
    pub fn revoke(&mut self, id: GrantId) -> Revoked<T> {
        let Some(grant) = self.grants.get_mut(&id).filter(|g| g.live) else {
            return Revoked::Unknown;
        };
        grant.live = false;
        if grant.uses == 0 {
            let grant = self.grants.remove(&id).expect("present");
            Revoked::Fenced(grant.payload)
        } else {
            Revoked::Draining { uses: grant.uses }
        }
    }

    /// Whether no byte can move under grant `id` any more: it is not live
    /// and no use of it is in flight (true for an id never made). Changes
    /// only by [`LocalGrants::revoke`] and [`LocalGrants::end_use`].
    pub fn is_fenced(&self, id: GrantId) -> bool {
        !self.grants.contains_key(&id)
    }

    /// The live grants, in no order (for announcing them again).
    pub fn live(&self) -> impl Iterator<Item = (GrantId, &T)> {
        self.grants
            .iter()
            .filter(|(_, g)| g.live)
            .map(|(&id, g)| (id, &g.payload))
    }

    /// Grants held, live and draining.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// True when no grant is held.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }

    /// Revokes every grant (the peer is gone); the payloads of those now
    /// fenced, for the caller to drop. The draining ones follow through
    /// [`LocalGrants::end_use`].
    pub fn revoke_all(&mut self) -> Vec<T> {
        let ids: Vec<GrantId> = self.grants.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| match self.revoke(id) {
                Revoked::Fenced(payload) => Some(payload),
                _ => None,
            })
            .collect()
    }
}

/// The grants a peer announced to this side and has not revoked, with
/// what the driver keeps of each (`D`: the decoded descriptor), bounded by
/// [`crate::PeerLimits::max_remote_grants`].
///
/// A revoked grant is simply forgotten: grant ids are never reused by
/// their engine, and the control messages of a connection arrive in order,
/// so no announcement of a revoked grant can follow its revoke.
#[derive(Debug)]
pub struct RemoteGrants<D> {
    grants: HashMap<GrantId, D>,
    max: usize,
}

impl<D> RemoteGrants<D> {
    /// An empty table holding at most `max` grants.
    pub fn new(max: usize) -> Self {
        Self {
            grants: HashMap::new(),
            max,
        }
    }

    /// Grant `id` announced (again, after a reconnection, replacing what
    /// was kept). A new grant past the bound is the peer misbehaving:
    /// nothing is kept and the peer should be dropped.
    pub fn announce(&mut self, id: GrantId, grant: D) -> Result<(), PeerMisbehaved> {
        if !self.grants.contains_key(&id) && self.grants.len() >= self.max {
            return Err(PeerMisbehaved::TooManyGrants { max: self.max });
        }
        self.grants.insert(id, grant);
        Ok(())
    }

    /// Grant `id` revoked: what was kept of it.
    pub fn revoke(&mut self, id: GrantId) -> Option<D> {
        self.grants.remove(&id)
    }

    /// Forgets every grant (the peer is gone: none can be used again),
    /// giving their memory back.
    pub fn clear(&mut self) {
        self.grants = HashMap::new();
    }

    /// Live grant `id`.
    pub fn get(&self, id: GrantId) -> Option<&D> {
        self.grants.get(&id)
    }

    /// Grants held.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: Terms = Terms {
        len: 4096,
        rights: Rights::ReadWrite,
    };

    #[test]
    fn uses_are_checked_against_rights_and_range() {
        let mut grants = LocalGrants::default();
        assert!(grants.insert(
            1,
            Terms {
                len: 100,
                rights: Rights::Read
            },
            "a"
        ));
        assert!(!grants.insert(1, RW, "again"), "ids are never reused");
        assert_eq!(grants.check(1, Access::Read, 0, 100), Ok(&"a"));
        assert_eq!(
            grants.check(1, Access::Write, 0, 1),
            Err(Refusal::AccessDenied {
                grant: 1,
                access: Access::Write
            })
        );
        for (offset, len) in [(0, 101), (100, 1), (1, 0), (u64::MAX, 2)] {
            assert!(
                matches!(
                    grants.check(1, Access::Read, offset, len),
                    Err(Refusal::OutOfBounds { .. })
                ),
                "{offset} + {len}"
            );
        }
        assert_eq!(
            grants.begin_use(2, Access::Read, 0, 1),
            Err(Refusal::NotGranted(2))
        );
    }

    #[test]
    fn a_revoke_with_no_use_in_flight_fences_at_once() {
        let mut grants = LocalGrants::default();
        grants.insert(7, RW, "region");
        assert!(!grants.is_fenced(7));
        assert_eq!(grants.revoke(7), Revoked::Fenced("region"));
        assert!(grants.is_fenced(7));
        assert_eq!(grants.revoke(7), Revoked::Unknown, "once");
        assert_eq!(
            grants.begin_use(7, Access::Write, 0, 1),
            Err(Refusal::NotGranted(7))
        );
    }

    /// The fence: a revoke refuses every later use at once, and the grant
    /// is fenced (its payload handed back) only when the last use in
    /// flight ends.
    #[test]
    fn a_revoke_waits_for_the_uses_in_flight_and_refuses_new_ones() {
        let mut grants = LocalGrants::default();
        grants.insert(7, RW, "region");
        grants.begin_use(7, Access::Write, 0, 4096).unwrap();
        grants.begin_use(7, Access::Read, 0, 16).unwrap();
        assert_eq!(grants.revoke(7), Revoked::Draining { uses: 2 });
        assert!(!grants.is_fenced(7), "two uses in flight");
        assert!(!grants.is_live(7));
        assert_eq!(grants.get(7), None);
        assert_eq!(
            grants.begin_use(7, Access::Write, 0, 1),
            Err(Refusal::NotGranted(7)),
            "no use begins after the revoke"
        );
        assert_eq!(grants.live().count(), 0, "not announced again");
        assert_eq!(grants.end_use(7), None);
        assert!(!grants.is_fenced(7));
        assert_eq!(grants.end_use(7), Some("region"), "the last use fences");
        assert!(grants.is_fenced(7));
        assert_eq!(grants.end_use(7), None, "an extra end changes nothing");
    }

    #[test]
    fn ending_uses_of_a_live_grant_keeps_it() {
        let mut grants = LocalGrants::default();
        grants.insert(3, RW, ());
        grants.begin_use(3, Access::Read, 0, 1).unwrap();
        assert_eq!(grants.end_use(3), None);
        assert!(grants.is_live(3));
        assert_eq!(grants.revoke(3), Revoked::Fenced(()));
    }

    #[test]
    fn revoking_everything_hands_back_the_fenced_and_drains_the_rest() {
        let mut grants = LocalGrants::default();
        grants.insert(1, RW, 1);
        grants.insert(2, RW, 2);
        grants.begin_use(2, Access::Read, 0, 1).unwrap();
        assert_eq!(grants.revoke_all(), vec![1]);
        assert_eq!(grants.len(), 1, "grant 2 drains");
        assert_eq!(grants.end_use(2), Some(2));
        assert!(grants.is_empty());
    }

    #[test]
    fn remote_grants_are_bounded_and_forgotten_on_revoke() {
        let mut remote = RemoteGrants::new(2);
        remote.announce(1, "one").unwrap();
        remote.announce(2, "two").unwrap();
        assert_eq!(
            remote.announce(3, "three"),
            Err(PeerMisbehaved::TooManyGrants { max: 2 })
        );
        assert_eq!(remote.get(3), None, "nothing kept past the bound");
        remote.announce(2, "two again").unwrap();
        assert_eq!(remote.get(2), Some(&"two again"), "re-announced");
        assert_eq!(remote.revoke(1), Some("one"));
        assert_eq!(remote.get(1), None);
        remote.announce(3, "three").unwrap();
        assert_eq!(remote.len(), 2);
    }
}
