//! The peer's messages (`Peer::send` on its side) this side received and
//! the application has not taken yet, bounded in count and bytes
//! ([`crate::PeerLimits::max_inbox_messages`],
//! [`crate::PeerLimits::max_inbox_bytes`]).

use std::collections::VecDeque;

use crate::PeerMisbehaved;

/// A bounded FIFO of received messages.
#[derive(Debug)]
pub struct Inbox {
    messages: VecDeque<Vec<u8>>,
    bytes: usize,
    max_messages: usize,
    max_bytes: usize,
}

impl Inbox {
    /// An empty inbox holding at most `max_messages` messages and
    /// `max_bytes` bytes of them.
    pub fn new(max_messages: usize, max_bytes: usize) -> Self {
        Self {
            messages: VecDeque::new(),
            bytes: 0,
            max_messages,
            max_bytes,
        }
    }

    /// A message arrived. Past either bound nothing is kept: the peer
    /// sent more than this side agreed to hold, and should be dropped.
    pub fn push(&mut self, message: Vec<u8>) -> Result<(), PeerMisbehaved> {
        if self.messages.len() >= self.max_messages {
            return Err(PeerMisbehaved::TooManyMessages {
                max: self.max_messages,
            });
        }
        if self.bytes.saturating_add(message.len()) > self.max_bytes {
            return Err(PeerMisbehaved::TooManyMessageBytes {
                max: self.max_bytes,
            });
        }
        self.bytes += message.len();
        self.messages.push_back(message);
        Ok(())
    }

    /// The oldest message. Changes by [`Inbox::push`] and this.
    pub fn pop(&mut self) -> Option<Vec<u8>> {
        let message = self.messages.pop_front()?;
        self.bytes -= message.len();
        Some(message)
    }

    /// Messages held.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inbox_is_bounded_in_count_and_bytes() {
        let mut inbox = Inbox::new(2, 10);
        inbox.push(vec![1; 4]).unwrap();
        assert_eq!(
            inbox.push(vec![2; 7]),
            Err(PeerMisbehaved::TooManyMessageBytes { max: 10 })
        );
        inbox.push(vec![3; 6]).unwrap();
        assert_eq!(
            inbox.push(Vec::new()),
            Err(PeerMisbehaved::TooManyMessages { max: 2 })
        );
        assert_eq!(
            (inbox.len(), inbox.bytes()),
            (2, 10),
            "nothing kept past a bound"
        );
        assert_eq!(inbox.pop(), Some(vec![1; 4]));
        assert_eq!(inbox.bytes(), 6);
        inbox.push(vec![4; 4]).unwrap();
        assert_eq!(inbox.pop(), Some(vec![3; 6]));
        assert_eq!(inbox.pop(), Some(vec![4; 4]));
        assert_eq!(inbox.pop(), None);
        assert_eq!(inbox.bytes(), 0);
    }
}
