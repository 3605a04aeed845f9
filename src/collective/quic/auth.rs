//! Authentication of every connection (protocol in the [module doc](super)): the key derived from the
//! cluster secret, the exporter-bound tokens and the frames that carry them, both sides of the exchange,
//! the certificate verifier that leaves membership to the tokens, and the certificate fingerprints that
//! pin each rank's identity once rank 0 has seen it.

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::{Connection, Endpoint, RecvStream, SendStream};

use super::endpoint::SERVER_NAME;
use super::framing::{read_frame, ReadFail};
use crate::collective::frame::{self, Header, Kind};

const EXPORTER_LABEL: &[u8] = b"EXPORTER-ringtrain-auth-v1";

/// Length of a token (a BLAKE3 hash): the most this side reads from a peer not yet authenticated.
const TOKEN_LEN: usize = 32;

/// The MAC key: derived from the cluster secret, or the fixed well-known loopback key without one.
pub(super) fn auth_key(secret: Option<&[u8]>) -> [u8; 32] {
    match secret {
        Some(s) => blake3::derive_key("ringtrain 2026-11 cluster secret v1", s),
        None => blake3::derive_key("ringtrain 2026-11 loopback without secret v1", b""),
    }
}

/// `MAC(key, role || exporter)` for this connection's TLS session; `role` is `b'C'` (connecting side) or
/// `b'S'` (accepting side).
fn auth_token(key: &[u8; 32], conn: &Connection, role: u8) -> Result<blake3::Hash, String> {
    let mut ekm = [0u8; 32];
    conn.export_keying_material(&mut ekm, EXPORTER_LABEL, b"")
        .map_err(|_| "TLS exporter unavailable".to_string())?;
    let mut m = [0u8; 33];
    m[0] = role;
    m[1..].copy_from_slice(&ekm);
    Ok(blake3::keyed_hash(key, &m))
}

/// The frame that carries one side's authentication token.
fn auth_frame(token: &blake3::Hash) -> Vec<u8> {
    frame::encode_frame(Header::unsequenced(Kind::Auth, 0), token.as_bytes())
}

/// Whether a received frame is an authentication frame holding exactly `want` (compared in constant time
/// by `blake3::Hash`'s `PartialEq`).
fn is_auth_token(h: &Header, payload: &[u8], want: &blake3::Hash) -> bool {
    h.kind == Kind::Auth && <[u8; 32]>::try_from(payload).is_ok_and(|bytes| blake3::Hash::from_bytes(bytes) == *want)
}

/// Connects to `addr` and runs the client side of the authentication exchange.
pub(super) async fn dial(
    ep: &Endpoint,
    addr: SocketAddr,
    key: &[u8; 32],
) -> Result<(Connection, SendStream, RecvStream), String> {
    let conn = ep
        .connect(addr, SERVER_NAME)
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| format!("cannot open stream to {addr}: {e}"))?;
    let tok = auth_token(key, &conn, b'C')?;
    send.write_all(&auth_frame(&tok))
        .await
        .map_err(|e| format!("send to {addr}: {e}"))?;
    let (h, p) = read_frame(&mut recv, TOKEN_LEN).await.map_err(|e| match e {
        ReadFail::Closed(s) => format!("authentication with {addr} failed (wrong cluster secret?): {s}"),
        ReadFail::Bad(b) => format!("authentication with {addr} failed: {b}"),
    })?;
    let want = auth_token(key, &conn, b'S')?;
    if !is_auth_token(&h, &p, &want) {
        conn.close(1u32.into(), b"authentication failed");
        return Err(format!(
            "{addr} failed to authenticate (it does not know the cluster secret)"
        ));
    }
    Ok((conn, send, recv))
}

/// Why an incoming connection was not accepted.
#[derive(Debug)]
pub(super) enum AcceptFail {
    /// The handshake failed, or the peer left before sending its token.
    Handshake(String),
    /// The peer's token is wrong: it does not know the cluster secret.
    Secret,
    /// This side gave up (its endpoint closing, its TLS exporter failing): nothing to blame the peer for.
    Local(String),
}

impl std::fmt::Display for AcceptFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AcceptFail::Handshake(e) => write!(f, "handshake failed (not a ringtrain peer?): {e}"),
            AcceptFail::Secret => write!(f, "authentication failed: wrong cluster secret"),
            AcceptFail::Local(e) => write!(f, "not accepted: {e}"),
        }
    }
}

/// Accepts an incoming connection and runs the server side of the authentication exchange: the client's
/// token is checked before this side says anything.
pub(super) async fn accept(
    incoming: quinn::Incoming,
    key: &[u8; 32],
) -> Result<(Connection, SendStream, RecvStream), AcceptFail> {
    let peer_failed = |e: quinn::ConnectionError| match e {
        quinn::ConnectionError::LocallyClosed => AcceptFail::Local(e.to_string()),
        e => AcceptFail::Handshake(e.to_string()),
    };
    let conn = incoming.await.map_err(peer_failed)?;
    let (mut send, mut recv) = conn.accept_bi().await.map_err(peer_failed)?;
    let res = read_frame(&mut recv, TOKEN_LEN).await;
    let want = auth_token(key, &conn, b'C').map_err(AcceptFail::Local)?;
    let ok = match &res {
        Ok((h, p)) => is_auth_token(h, p, &want),
        Err(ReadFail::Closed(s)) => return Err(AcceptFail::Handshake(format!("left before authenticating: {s}"))),
        Err(ReadFail::Bad(_)) => false,
    };
    if !ok {
        conn.close(1u32.into(), b"authentication failed: wrong cluster secret");
        return Err(AcceptFail::Secret);
    }
    let tok = auth_token(key, &conn, b'S').map_err(AcceptFail::Local)?;
    send.write_all(&auth_frame(&tok))
        .await
        .map_err(|e| AcceptFail::Handshake(e.to_string()))?;
    Ok((conn, send, recv))
}

/// BLAKE3 of a certificate's DER encoding: what a rank's identity is pinned by.
pub type Fingerprint = [u8; 32];

/// The fingerprint of a certificate.
pub(super) fn fingerprint(cert_der: &[u8]) -> Fingerprint {
    *blake3::hash(cert_der).as_bytes()
}

/// The fingerprint of the certificate the peer presented in this connection's handshake (both sides
/// present one, see [`ExporterBound`]).
pub(super) fn peer_fingerprint(conn: &Connection) -> Option<Fingerprint> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    certs.first().map(|c| fingerprint(c))
}

/// Checks that the peer on `conn` presented the certificate `rank` presented at rendezvous.
pub(super) fn check_pinned(conn: &Connection, rank: usize, pinned: &Fingerprint) -> Result<(), String> {
    match peer_fingerprint(conn) {
        Some(f) if f == *pinned => Ok(()),
        Some(_) => Err(format!(
            "{} presented a certificate other than the one rank {rank} presented at rendezvous",
            conn.remote_address()
        )),
        None => Err(format!("{} presented no certificate", conn.remote_address())),
    }
}

/// Accepts any certificate, as server or client certificate, but checks the handshake signatures: the
/// certificate proves that the peer holds its key, which is what pinning needs; membership comes from
/// the exporter-bound MAC. Client certificates are mandatory, so every connection names one.
#[derive(Debug)]
pub(super) struct ExporterBound(pub(super) Arc<rustls::crypto::CryptoProvider>);

impl rustls::server::danger::ClientCertVerifier for ExporterBound {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

impl rustls::client::danger::ServerCertVerifier for ExporterBound {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
