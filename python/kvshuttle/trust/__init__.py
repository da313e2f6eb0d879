"""The trust boundary: the deployment secret, the keys it yields, and retention grants (docs/SECURITY.md).

Imports only the standard library (pyzmq lazily, for CURVE keys), so every floor can use it.
"""

from .grants import GRANT_FIELD, GRANT_TTL_S, GrantBook, grant_terms, grant_valid, issue_grant
from .secret import SECRET_ENV, SECRET_FILE_ENV, DeploymentSecret, TrustError, is_loopback

__all__ = [
    "GRANT_FIELD",
    "GRANT_TTL_S",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "DeploymentSecret",
    "GrantBook",
    "TrustError",
    "grant_terms",
    "grant_valid",
    "is_loopback",
    "issue_grant",
]
