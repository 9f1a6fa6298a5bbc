"""HTTPS (issue 23's operator checklist): `fedlang serve --ssl-keyfile --ssl-certfile`
with a self-signed certificate made here; a client that trusts it enrolls and checks
in, one that does not is refused before it sends a token."""

import datetime
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedlang import deploy

from ...cli._run import ENV
from ..conftest import _free_port


def _self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem, cert_pem = tmp_path / "tls.key", tmp_path / "tls.crt"
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_pem, cert_pem


@pytest.fixture
def https_server(tmp_path):
    key_pem, cert_pem = _self_signed(tmp_path)
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedlang", "serve", "--db", str(tmp_path / "s.db"), "--port",
         str(port), "--ssl-keyfile", str(key_pem), "--ssl-certfile", str(cert_pem),
         "--admin-token", "tls-admin-token"],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    url = f"https://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                trusted = ssl.create_default_context(cafile=str(cert_pem))
                if httpx.get(f"{url}/v1/status", verify=trusted, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < end, (tmp_path / "server.log").read_text()
                time.sleep(0.1)
        yield url, cert_pem
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def test_clients_reach_an_https_server_that_they_trust(https_server):
    url, cert = https_server
    trusted = ssl.create_default_context(cafile=str(cert))
    with deploy.Admin(url, "tls-admin-token", verify=trusted) as admin:
        token = admin.create_population("pop")
    with deploy.Client(url, "pop", token, {"train": [[1.0]]}, verify=trusted, patience=5) as c:
        assert c.enroll().startswith("c-")
        answer = c.connection.json("POST", "/v1/checkin", token=c.credential)
        assert answer["task"] is None and not answer["finished"]
    # a client that does not trust the certificate is refused before anything is sent
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/v1/status", timeout=5)
    with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
        httpx.get(url.replace("https", "http") + "/v1/status", timeout=5)
