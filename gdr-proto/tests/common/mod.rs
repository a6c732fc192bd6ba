//! What the two-endpoint pair tests share: one direction of a connection
//! ([`Link`]) carrying control messages encoded with `wire`, in order, that
//! a test can delay, drop from, rewrite (a misbehaving sender) or cut; the
//! count of how each request ended; the memory a test expects.

// Each pair test uses a part of it.
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::hash::Hash;

use gdr_proto::wire::Control;

/// How a misbehaving sender changes what it sends.
type Rewrite = Box<dyn for<'a> FnMut(Control<'a>) -> Control<'a>>;

/// One direction of a connection: what is sent arrives whole and in order
/// (a reliable queue pair) unless the link is cut, and arrives only while
/// the link is not held.
#[derive(Default)]
pub struct Link {
    queue: VecDeque<Vec<u8>>,
    held: bool,
    cut: bool,
    lose: Option<fn(&Control<'_>) -> bool>,
    rewrite: Option<Rewrite>,
    /// Messages lost: sent after the cut, on it when it was cut, or
    /// dropped.
    pub lost: usize,
}

impl Link {
    /// Encodes `message` (as the sender's rewrite has it) onto the link.
    pub fn send(&mut self, message: &Control<'_>) {
        let message = match self.rewrite.as_mut() {
            Some(rewrite) => rewrite(message.clone()),
            None => message.clone(),
        };
        let bytes = message.encode().expect("every message sent encodes");
        if self.cut || self.lose.is_some_and(|lose| lose(&message)) {
            self.lost += 1;
        } else {
            self.queue.push_back(bytes);
        }
    }

    /// Hands every message on the link to `receive`, decoded as the
    /// receiver decodes it, unless the link is held.
    pub fn deliver(&mut self, mut receive: impl FnMut(Control<'_>)) {
        while !self.held {
            let Some(bytes) = self.queue.pop_front() else {
                break;
            };
            receive(Control::decode(&bytes).expect("every message received decodes"));
        }
    }

    /// Delays what is on the link, and what is sent, until
    /// [`Link::release`].
    pub fn hold(&mut self) {
        self.held = true;
    }

    /// Lets the messages delayed go, in order.
    pub fn release(&mut self) {
        self.held = false;
    }

    /// The connection is gone: what is on the link is lost, and so is
    /// everything sent later.
    pub fn cut(&mut self) {
        self.lost += self.queue.len();
        self.queue.clear();
        self.cut = true;
    }

    /// From now on the messages `lose` picks are dropped when sent.
    pub fn lose(&mut self, lose: fn(&Control<'_>) -> bool) {
        self.lose = Some(lose);
    }

    /// From now on the sender misbehaves: what it sends is `rewrite`'s.
    pub fn rewrite(&mut self, rewrite: impl for<'a> FnMut(Control<'a>) -> Control<'a> + 'static) {
        self.rewrite = Some(Box::new(rewrite));
    }

    /// Whether a message `what` picks is on the link.
    pub fn carries(&self, what: impl Fn(&Control<'_>) -> bool) -> bool {
        self.queue
            .iter()
            .any(|bytes| what(&Control::decode(bytes).expect("decodes")))
    }
}

/// How each of `ids` ended, checking that each ended exactly once and that
/// nothing else did (`ends`: every end reported, in order).
pub fn ended_once<K, O>(ends: &[(K, O)], ids: &[K]) -> HashMap<K, O>
where
    K: Copy + Eq + Hash + Debug,
    O: Clone + Debug,
{
    let mut count: HashMap<K, usize> = HashMap::new();
    for (id, _) in ends {
        *count.entry(*id).or_default() += 1;
    }
    for id in ids {
        assert_eq!(
            count.remove(id),
            Some(1),
            "request {id:?} must end exactly once: {ends:?}"
        );
    }
    assert!(count.is_empty(), "ends of requests never made: {count:?}");
    ends.iter()
        .map(|(id, outcome)| (*id, outcome.clone()))
        .collect()
}

/// `base` with `len` bytes at `at` replaced by those at `from` of `src`:
/// what a memory should hold once exactly that range was copied into it.
pub fn with(base: &[u8], at: usize, src: &[u8], from: usize, len: u64) -> Vec<u8> {
    let mut out = base.to_vec();
    let n = len as usize;
    out[at..at + n].copy_from_slice(&src[from..from + n]);
    out
}
