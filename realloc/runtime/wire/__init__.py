"""What crosses a socket between the master and the workers: typed HMAC-signed messages (``protocol.py``)
and CURVE encryption with the master's ZAP gatekeeper (``curve.py``)."""
