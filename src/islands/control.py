"""The elastic job's control plane and state transfer (public names; docs/membership.md).

Membership store: connect(address, token, job) -> a member's view of the job, JobSpec (what a job is), Refused (a
    join turned away), observe_job(address, token) (read a running job's membership without joining; the old name
    observe is deprecated: it collided with the islands.observe package)
Authentication (SOTA-930): ControlAuth (HMAC-SHA256 envelopes under the job token, per-sender counters against
    replay), AuthStore (a torch Store whose forged, altered and replayed values read as absent), mac_payload (a MAC
    over a tensor payload, for callers who authenticate their own bytes), authenticate_payloads(world, token) (every
    outer strategy built on `world` afterwards exchanges HMAC-tagged payloads; AuthenticatedComm, PayloadAuthError)
Live recovery (SOTA-931): StateImage (a state cut into checksummed chunks), StateServer (serves one over TCP),
    fetch_state(peers, ...) (a joiner pulls the chunks from every peer, refetching damaged ones), RecoveryError
"""

from islands._deprecated import alias_getattr
from islands.runtime.elastic.auth import AuthStore, ControlAuth, mac_payload
from islands.runtime.elastic.membership import JobSpec, Refused, connect, observe as observe_job
from islands.runtime.elastic.recovery import RecoveryError, StateImage, StateServer, fetch_state
from islands.runtime.payload_auth import AuthenticatedComm, PayloadAuthError, authenticate_payloads

__all__ = [
    "AuthStore",
    "AuthenticatedComm",
    "ControlAuth",
    "JobSpec",
    "PayloadAuthError",
    "RecoveryError",
    "Refused",
    "StateImage",
    "StateServer",
    "authenticate_payloads",
    "connect",
    "fetch_state",
    "mac_payload",
    "observe_job",
]

__getattr__ = alias_getattr(__name__)  # observe: deprecated, now observe_job (docs/deprecations.md)
