//! One peer's connection: the protocol state the engine keeps per peer,
//! in one object (quinn-proto's `Connection` is the model).
//!
//! A [`Connection`] owns what this side knows of one peer: the batches on
//! its queue pairs ([`Batches`]: what is queued, in flight, and when each
//! batch ends), the re-establishment of failed queue pairs
//! ([`Recovery`]), both sides of the slotted rendezvous ([`Rendezvous`]:
//! the peer's requests served through this side's landing slots, and
//! this side's through the peer's), the peer-copy path's state
//! ([`PeerCopy`]: this side's copies to the peer a window at a time, the
//! grants exported to it, the releases owed it), the grants both ways
//! (this side's announcements, kept to announce again on a new queue
//! pair 0, and the peer's, bounded), the peer's messages nobody received
//! ([`Inbox`]), this side's messages waiting for a send slot
//! ([`Outbox`]), the peer's devices (its paths) and whether it said
//! goodbye.
//!
//! Inputs: the connection-level control messages ([`Connection::on_control`]
//! takes them, hands any other back), this side's own messages and grants
//! ([`Connection::send`], [`Connection::announce`]), its batches' work,
//! completions and failures (through [`Connection::batches_mut`]), time
//! ([`Connection::handle_timeout`]). Outputs: messages to put in a send
//! slot ([`Connection::poll_transmit`]), messages past their deadline,
//! what the peer's messages changed ([`Event`]), the batches' work to post
//! and their actions ([`Batches::take_postable`], [`Batches::poll_action`]),
//! and one [`Connection::poll_timeout`] covering every deadline it keeps.
//! The driver owns the transport (queue pairs, send slots, receives) and
//! the requests' form ([`Requests`]: `gdr-core` posts verbs work requests,
//! the tests plain records): nothing here names a verb, so the same object
//! serves any transport that carries the control messages and the
//! operations.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use crate::PeerMisbehaved;
use crate::batches::{Batches, Requests};
use crate::grants::{GrantId, RemoteGrants};
use crate::inbox::Inbox;
use crate::limits::PeerLimits;
use crate::outbox::{Outbox, OutboxFull, Waiting};
use crate::peer_copy::PeerCopy;
use crate::reconnect::{GiveUp, Recovery};
use crate::rendezvous::Rendezvous;
use crate::wire::Control;

/// What a connection needs of a grant descriptor the peer announced: the
/// driver's own type (the engine's memory descriptor), decoded here so
/// that a malformed or foreign one drops the peer by the same rule
/// everywhere.
pub trait Descriptor: Sized {
    /// Why bytes are not a descriptor (logged by the driver).
    type Error: fmt::Debug;
    /// Decodes an announced descriptor.
    fn decode(bytes: &[u8]) -> Result<Self, Self::Error>;
    /// The engine whose memory it describes.
    fn owner(&self) -> u64;
    /// Its grant's id.
    fn grant(&self) -> GrantId;
}

/// What a connection is made with.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionConfig {
    /// The peer's engine id (from its handshake).
    pub peer_engine: u64,
    /// The session's id.
    pub session: u64,
    /// Queue pairs of the session.
    pub qp_count: usize,
    /// Whether this side connected (it re-establishes failed queue pairs).
    pub connector: bool,
    /// How long a failed queue pair may take to come back.
    pub reconnect_timeout: Duration,
    /// The largest control message the peer receives (from its handshake).
    pub peer_max_message: usize,
    /// This side's messages that may wait for a send slot.
    pub max_outbox: usize,
    /// The bounds on what the peer may make this side hold.
    pub limits: PeerLimits,
}

/// What a connection-level control message changed, for the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A message went into the inbox.
    Message,
    /// The peer announced grant `0`.
    GrantAnnounced(GrantId),
    /// The peer revoked grant `0`, one it had announced (a revoke of an
    /// unknown grant tells nothing).
    GrantRevoked(GrantId),
    /// The peer said which of its devices each queue pair reaches
    /// ([`Connection::remote_device`]).
    PathsKnown,
    /// The peer said goodbye: its grants are gone with it.
    Goodbye,
}

/// A message of another protocol (the staged or the peer-copy path's),
/// handed back by [`Connection::on_control`].
#[derive(Debug)]
pub enum Received<'m> {
    /// Taken: what it changed.
    Event(Event),
    /// Taken, nothing changed: a revoke of a grant the peer never
    /// announced or already revoked.
    Stale,
    /// Not a connection-level message.
    Other(Control<'m>),
}

/// Why [`Connection::send`] refused a message (its token handed back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendRefused {
    /// The peer said goodbye: nothing goes to it any more.
    #[error("the peer said goodbye")]
    Goodbye,
    /// Larger than the peer receives.
    #[error("a control message of {len} bytes is larger than the peer's {max}")]
    TooLarge {
        /// The message's length.
        len: usize,
        /// The peer's largest.
        max: usize,
    },
    /// The outbox is full.
    #[error(transparent)]
    Full(#[from] OutboxFull),
}

/// What [`Connection::poll_transmit`] hands the driver.
#[derive(Debug)]
pub enum Transmit<T> {
    /// Past its deadline before a send slot came: end it with a timeout.
    Expired(Waiting<T>),
    /// Put it in a send slot now.
    Send(Waiting<T>),
}

/// One peer's protocol state (see the module docs): its grants are
/// descriptors `D`, its batches' requests and its messages' tokens are
/// `R`'s (a message ends the same notification a batch does).
#[derive(Debug)]
pub struct Connection<D, R: Requests> {
    /// The batches on the peer's queue pairs.
    batches: Batches<R>,
    peer_engine: u64,
    session: u64,
    peer_max_message: usize,
    recovery: Recovery,
    /// This side's grants to the peer not revoked, encoded: announced
    /// again on a new queue pair 0 (one in flight on the old may be lost).
    announced: HashMap<GrantId, Vec<u8>>,
    remote: RemoteGrants<D>,
    inbox: Inbox,
    outbox: Outbox<R::Notify>,
    /// The peer's device behind each queue pair, once it said.
    remote_devices: Option<Vec<String>>,
    said_goodbye: bool,
    /// Both sides of the slotted rendezvous with the peer.
    rendezvous: Rendezvous,
    /// The peer-copy path's state: this side's flights to the peer, the
    /// grants exported to it (each kept by an `R::Hold`), the releases
    /// owed it.
    peer_copy: PeerCopy<R::Hold>,
}

impl<D: Descriptor, R: Requests> Connection<D, R> {
    /// A connection just set up, no queue pair in its batches yet
    /// ([`Batches::add_qp`]).
    pub fn new(config: &ConnectionConfig) -> Self {
        let limits = &config.limits;
        Self {
            batches: Batches::new(),
            peer_engine: config.peer_engine,
            session: config.session,
            peer_max_message: config.peer_max_message,
            recovery: Recovery::new(config.qp_count, config.connector, config.reconnect_timeout),
            announced: HashMap::new(),
            remote: RemoteGrants::new(limits.max_remote_grants),
            inbox: Inbox::new(limits.max_inbox_messages, limits.max_inbox_bytes),
            outbox: Outbox::new(config.max_outbox),
            remote_devices: None,
            said_goodbye: false,
            rendezvous: Rendezvous::new(limits),
            peer_copy: PeerCopy::default(),
        }
    }

    /// The peer's engine id.
    pub fn peer_engine(&self) -> u64 {
        self.peer_engine
    }

    /// The session's id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The largest control message the peer receives.
    pub fn peer_max_message(&self) -> usize {
        self.peer_max_message
    }

    /// Both sides of the slotted rendezvous with the peer.
    pub fn rendezvous(&self) -> &Rendezvous {
        &self.rendezvous
    }

    /// Both sides of the slotted rendezvous with the peer, to step.
    pub fn rendezvous_mut(&mut self) -> &mut Rendezvous {
        &mut self.rendezvous
    }

    /// Lends both sides of the rendezvous out, for a driver that steps
    /// them while it sends and posts through the rest of the connection;
    /// an idle pair stands in until [`Connection::return_rendezvous`]
    /// (meanwhile [`Connection::poll_timeout`] and
    /// [`Connection::handle_timeout`] do not see the lent one's deadlines:
    /// return it before either is asked).
    pub fn lend_rendezvous(&mut self) -> Rendezvous {
        std::mem::replace(
            &mut self.rendezvous,
            Rendezvous::new(&PeerLimits::default()),
        )
    }

    /// Takes back what [`Connection::lend_rendezvous`] lent.
    pub fn return_rendezvous(&mut self, rendezvous: Rendezvous) {
        self.rendezvous = rendezvous;
    }

    /// The peer-copy path's state with the peer.
    pub fn peer_copy(&self) -> &PeerCopy<R::Hold> {
        &self.peer_copy
    }

    /// The peer-copy path's state with the peer, to step.
    pub fn peer_copy_mut(&mut self) -> &mut PeerCopy<R::Hold> {
        &mut self.peer_copy
    }

    /// Lends the peer-copy state out, as [`Connection::lend_rendezvous`]
    /// lends the rendezvous (an empty one stands in; return it before
    /// [`Connection::poll_timeout`] or a `handle_timeout` is asked).
    pub fn lend_peer_copy(&mut self) -> PeerCopy<R::Hold> {
        std::mem::take(&mut self.peer_copy)
    }

    /// Takes back what [`Connection::lend_peer_copy`] lent.
    pub fn return_peer_copy(&mut self, peer_copy: PeerCopy<R::Hold>) {
        self.peer_copy = peer_copy;
    }

    /// The batches on its queue pairs.
    pub fn batches(&self) -> &Batches<R> {
        &self.batches
    }

    /// The batches on its queue pairs (the driver submits, posts and feeds
    /// completions through them).
    pub fn batches_mut(&mut self) -> &mut Batches<R> {
        &mut self.batches
    }

    /// Re-establishing its failed queue pairs.
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// Re-establishing its failed queue pairs (the driver feeds it what
    /// its queue pairs did).
    pub fn recovery_mut(&mut self) -> &mut Recovery {
        &mut self.recovery
    }

    // The peer's messages.

    /// Takes control message `message` from the peer. A message of
    /// another protocol comes back ([`Received::Other`]); `Err`: the peer
    /// broke the protocol or a bound and is to be dropped.
    pub fn on_control<'m>(&mut self, message: Control<'m>) -> Result<Received<'m>, PeerMisbehaved> {
        let event = match message {
            Control::User(payload) => {
                self.inbox.push(payload.to_vec())?;
                Event::Message
            }
            Control::GrantAnnounce { descriptor } => {
                let Ok(d) = D::decode(descriptor) else {
                    return Err(PeerMisbehaved::MalformedGrant);
                };
                if d.owner() != self.peer_engine {
                    return Err(PeerMisbehaved::ForeignGrant {
                        owner: d.owner(),
                        peer: self.peer_engine,
                    });
                }
                let grant = d.grant();
                self.remote.announce(grant, d)?;
                Event::GrantAnnounced(grant)
            }
            Control::GrantRevoke { grant } => {
                // Only a grant it announced counts: ids are never reused,
                // so one revoked stays revoked.
                match self.remote.revoke(grant) {
                    Some(_) => Event::GrantRevoked(grant),
                    None => return Ok(Received::Stale),
                }
            }
            Control::Paths { devices } => {
                let names = String::from_utf8_lossy(devices);
                self.remote_devices = Some(names.split(',').map(str::to_owned).collect());
                Event::PathsKnown
            }
            Control::Goodbye => {
                self.said_goodbye = true;
                // Nothing reaches its grants any more: their table goes
                // now, not with the connection.
                self.remote.clear();
                Event::Goodbye
            }
            other => return Ok(Received::Other(other)),
        };
        Ok(Received::Event(event))
    }

    /// The peer's next message nobody received.
    pub fn receive(&mut self) -> Option<Vec<u8>> {
        self.inbox.pop()
    }

    /// The peer's messages nobody received, and their bytes.
    pub fn inbox_len(&self) -> (usize, usize) {
        (self.inbox.len(), self.inbox.bytes())
    }

    /// The peer's live grant `id`.
    pub fn remote_grant(&self, id: GrantId) -> Option<&D> {
        self.remote.get(id)
    }

    /// The peer's live grants.
    pub fn remote_grants(&self) -> usize {
        self.remote.len()
    }

    /// Forgets the peer's grants (it is dropped or gone).
    pub fn forget_remote_grants(&mut self) {
        self.remote.clear();
    }

    /// The peer's device behind queue pair `index`, once it said.
    pub fn remote_device(&self, index: usize) -> Option<&str> {
        self.remote_devices.as_ref()?.get(index).map(String::as_str)
    }

    /// Whether the peer said which devices its queue pairs reach (the
    /// connector's sign that its session was accepted).
    pub fn paths_known(&self) -> bool {
        self.remote_devices.is_some()
    }

    /// Whether the peer said goodbye.
    pub fn said_goodbye(&self) -> bool {
        self.said_goodbye
    }

    // This side's messages and grants.

    /// Queues the encoded control message `bytes`, ended by `token`, to go
    /// out within `timeout` of `now`. Refused (token handed back) past
    /// the peer's message size or the outbox's bound, or once the peer
    /// said goodbye; nothing queued is lost.
    pub fn send(
        &mut self,
        bytes: Vec<u8>,
        token: R::Notify,
        now: Instant,
        timeout: Duration,
    ) -> Result<(), (SendRefused, R::Notify)> {
        if self.said_goodbye {
            return Err((SendRefused::Goodbye, token));
        }
        let (len, max) = (bytes.len(), self.peer_max_message);
        if len > max {
            return Err((SendRefused::TooLarge { len, max }, token));
        }
        self.outbox
            .push(bytes, token, now, timeout)
            .map_err(|(full, token)| (full.into(), token))
    }

    /// The next message to hand the transport: one past its deadline at
    /// `now` first (the oldest; it ends with a timeout), else, when
    /// `can_send` (a send slot free, queue pair 0 up), the oldest waiting.
    /// Changes by [`Connection::send`] and this.
    pub fn poll_transmit(&mut self, now: Instant, can_send: bool) -> Option<Transmit<R::Notify>> {
        if let Some(late) = self.outbox.poll_expired(now) {
            return Some(Transmit::Expired(late));
        }
        if can_send {
            return self.outbox.pop().map(Transmit::Send);
        }
        None
    }

    /// This side's messages waiting for a send slot.
    pub fn outbox_len(&self) -> usize {
        self.outbox.len()
    }

    /// Records this side's grant `id` to the peer, `encoded` as announced.
    pub fn announce(&mut self, id: GrantId, encoded: Vec<u8>) {
        self.announced.insert(id, encoded);
    }

    /// This side revoked its grant `id`: not announced again.
    pub fn forget_announced(&mut self, id: GrantId) -> bool {
        self.announced.remove(&id).is_some()
    }

    /// This side's live grants to the peer, encoded (announced again on a
    /// new queue pair 0).
    pub fn announced(&self) -> impl Iterator<Item = &[u8]> {
        self.announced.values().map(Vec::as_slice)
    }

    /// This side's live grants to the peer.
    pub fn announced_len(&self) -> usize {
        self.announced.len()
    }

    // Time.

    /// The earliest deadline the connection keeps: a batch's, a queue
    /// pair's re-establishment, the oldest waiting message, a request of
    /// the rendezvous either way, a peer copy's or an export's bound. The
    /// driver calls
    /// [`Connection::handle_timeout`] and [`Connection::poll_transmit`] by
    /// then. Changes by every call that changes any of them (a batch
    /// submitted or ended included).
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        [
            self.batches.next_deadline(),
            self.recovery.poll_timeout(),
            self.outbox.poll_timeout(),
            self.rendezvous.poll_timeout(),
            self.peer_copy.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Handles the deadlines up to `now`: batches past theirs stop (their
    /// actions come out of [`Batches::poll_action`]); rendezvous requests
    /// past theirs fail (their actions come out of each side's
    /// `poll_action`); peer copies past theirs stop (their outcome comes
    /// out of their flight), exports past their bound are given up on
    /// (what kept them let go of here); queue pairs not re-established
    /// are given up, each with why (returned; messages past their
    /// deadline come out of [`Connection::poll_transmit`]).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(usize, GiveUp)> {
        drop(self.handle_work_timeout(now));
        self.recovery.handle_timeout(now)
    }

    /// The part of [`Connection::handle_timeout`] for a driver that gives
    /// up queue pairs elsewhere: the batches', the rendezvous' and the
    /// peer copies' deadlines. Returns the exports given up on at their
    /// bound, with what kept them.
    pub fn handle_work_timeout(&mut self, now: Instant) -> Vec<(GrantId, R::Hold)> {
        self.batches.handle_timeout(now);
        self.rendezvous.handle_timeout(now);
        self.peer_copy.handle_timeout(now)
    }
}

#[cfg(test)]
mod tests;
