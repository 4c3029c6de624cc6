"""Prefill/decode disaggregation (issue 21): a prefill engine hands a request over to a decode
engine after its first token; the prompt's KV blocks travel through a KV connector.

    handover.py   the record that crosses from the prefill side to the decode side
    connector.py  the KV connector interface (stage on the prefill side, fetch on the decode side)
    shm.py        shared-memory connector (engines on one host)
    tcp.py        TCP connector (engines on different hosts): server pool, fetch, release
    wire.py       its authenticated stream: HMAC handshake, MAC'd frames, one deadline
    secret.py     the pair's shared secret (0600 file) and the loopback rule without one
    prefill.py    prefill-role glue: the engine hook that turns a first token into a hand-over
    decode.py     decode-role glue: admit a hand-over into the decode engine's own pool
    placer.py     the decode role's thread for large hand-overs' fetch + KV write
    pair.py       in-process router: one prefill + one decode engine, one output stream
"""
