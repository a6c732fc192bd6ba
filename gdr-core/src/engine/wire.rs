//! The engine's wire formats: the connection handshake and control-message framing.
