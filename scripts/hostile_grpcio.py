#!/usr/bin/env python3
"""A hostile tenant that is not Tandem's code: Google's gRPC for Python (grpcio, asyncio API)
with stubs generated at start-up from proto/tandem/v1/tandem.proto (grpcio-tools), its own
connections (one per 100 sessions, never shared with the victim's), and its own TCP proxy where
an attack needs the network to misbehave. `tandem bench hostile --attacker grpcio` runs it beside
a victim tenant; alone:

    hostile_grpcio.py --target 127.0.0.1:PORT --key KEY --fingerprint HEX --prompt-ids 1,2,3 \
        --attack idle-sessions --seconds 25

Runs one attack for --seconds, then prints what it saw as one JSON line:
{"opened": …, "refused": …, "cut": …, "tokens": …}.

The attacks (the same as `tandem bench hostile`'s own, written again from the protocol):
  oversized-q      rejection-sampling drafts whose q holds 100,000 entries
  bad-draft-flood  10,000 malformed drafts per session, none of whose refusals is read
  idle-sessions    1,100 sessions opened and left alone (no blocks, no acks, nothing read)
  silent-streams   300 session streams that never send Open, each started again when cut
  slow-reader      4 cloud-only streams read through a proxy passing a byte a second
  frozen-peer      50 sessions whose proxy stops forwarding after Opened (a half-open peer)
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile

PROTOCOL_VERSION = 7
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "proto")


def load_stubs():
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="tandem-grpcio-")
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "tandem/v1/tandem.proto",
        ]
    )
    if rc != 0:
        sys.exit(f"grpc_tools.protoc failed on {ROOT}/tandem/v1/tandem.proto ({rc})")
    sys.path.insert(0, out)
    from tandem.v1 import tandem_pb2, tandem_pb2_grpc  # noqa: E402

    return tandem_pb2, tandem_pb2_grpc


pb, rpc = load_stubs()
import grpc  # noqa: E402


class Tally:
    def __init__(self):
        self.opened = self.refused = self.cut = self.tokens = 0

    def json(self):
        return json.dumps(
            {"opened": self.opened, "refused": self.refused, "cut": self.cut, "tokens": self.tokens}
        )


class Attacker:
    def __init__(self, a):
        self.a = a
        self.md = [("authorization", f"Bearer {a.key}")] if a.key else []
        self.prompt = [int(x) for x in a.prompt_ids.split(",") if x]
        self.tally = Tally()
        self.stop = asyncio.Event()
        self.channels = []

    def channel(self, target=None):
        # A connection of its own: grpcio shares subchannels between channels to the same
        # target unless told not to.
        ch = grpc.aio.insecure_channel(
            target or self.a.target,
            options=[
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_send_message_length", 8 << 20),
            ],
        )
        self.channels.append(ch)
        return rpc.VerifierStub(ch)

    def open_msg(self, temperature=0.0, rule=1, max_tokens=2000):
        return pb.EdgeMessage(
            open=pb.Open(
                protocol_version=PROTOCOL_VERSION,
                tokenizer_fingerprint=self.a.fingerprint,
                prompt_ids=self.prompt,
                params=pb.SamplingParams(temperature=temperature, top_k=0, top_p=1.0, seed=1),
                max_tokens=max_tokens,
                rule=rule,
                want_draft_len=4,
                want_depth=2,
            )
        )

    async def opened(self, call):
        """Read past Admitted to Opened (True) or a refusal (False)."""
        while True:
            m = await call.read()
            if m is grpc.aio.EOF:
                return False
            kind = m.WhichOneof("kind")
            if kind == "opened":
                return True
            if kind == "error":
                return False

    async def session(self, stub, msg):
        call = stub.Session(metadata=self.md)
        try:
            await call.write(msg)
            ok = await self.opened(call)
        except grpc.aio.AioRpcError:
            ok = False
        if ok:
            self.tally.opened += 1
            return call
        self.tally.refused += 1
        call.cancel()
        return None

    def draft(self, tokens, q=()):
        return pb.EdgeMessage(
            draft=pb.Draft(
                epoch=0, block=0, start_pos=len(self.prompt) + 1, tokens=tokens, q=list(q)
            )
        )

    # The attacks.

    async def idle_sessions(self, n=1100):
        stubs = [self.channel() for _ in range((n + 99) // 100)]
        calls = await asyncio.gather(
            *(self.session(stubs[i // 100], self.open_msg()) for i in range(n))
        )
        await self.stop.wait()
        for c in calls:
            if c is not None:
                c.cancel()

    async def silent_streams(self, n=300):
        stub = self.channel()

        async def one():
            while not self.stop.is_set():
                call = stub.Session(metadata=self.md)
                self.tally.opened += 1
                try:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                except grpc.aio.AioRpcError:
                    pass
                self.tally.cut += 1

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await self.stop.wait()
        for t in tasks:
            t.cancel()

    async def oversized_q(self):
        q = pb.SparseDist(entries=[pb.TokenProb(token=5, prob=1e-6)] * 100_000)
        while not self.stop.is_set():
            call = await self.session(self.channel(), self.open_msg(0.8, 3, 64))
            if call is None:
                continue
            try:
                while not self.stop.is_set():
                    await call.write(self.draft([5], [q]))
                    refused = False
                    while True:
                        m = await call.read()
                        if m is grpc.aio.EOF:
                            break
                        if m.WhichOneof("kind") == "error":
                            refused = True
                            break
                    if not refused:
                        break
                    self.tally.refused += 1
            except grpc.aio.AioRpcError:
                pass
            self.tally.cut += 1
            call.cancel()

    async def bad_draft_flood(self):
        while not self.stop.is_set():
            call = await self.session(self.channel(), self.open_msg(0.0, 1, 200))
            if call is None:
                continue
            try:
                for _ in range(10_000):
                    if self.stop.is_set():
                        break
                    await call.write(self.draft([999_999]))
                while True:
                    m = await call.read()
                    if m is grpc.aio.EOF:
                        break
                    if m.WhichOneof("kind") == "error":
                        self.tally.refused += 1
            except grpc.aio.AioRpcError:
                pass
            self.tally.cut += 1
            call.cancel()

    async def slow_reader(self, n=4, tokens=1500):
        proxy = await Proxy.start(self.a.target, trickle=1.0)

        async def one():
            stub = self.channel(proxy.addr)
            req = pb.GenerateRequest(
                tokenizer_fingerprint=self.a.fingerprint,
                prompt_ids=self.prompt,
                max_tokens=tokens,
            )
            try:
                call = stub.Generate(req, metadata=self.md)
                self.tally.opened += 1
                async for m in call:
                    self.tally.tokens += len(m.tokens)
            except grpc.aio.AioRpcError:
                self.tally.cut += 1

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await self.stop.wait()
        for t in tasks:
            t.cancel()
        proxy.close()

    async def frozen_peer(self, n=50):
        proxy = await Proxy.start(self.a.target)
        calls = []
        for _ in range(n):
            if self.stop.is_set():
                break
            calls.append(await self.session(self.channel(proxy.addr), self.open_msg()))
        proxy.frozen = True
        await self.stop.wait()
        proxy.close()


class Proxy:
    """A TCP proxy on loopback: whole, or passing the upstream's bytes one per `trickle` seconds
    (after the first 512: the HTTP/2 handshake and headers); `frozen` stops it forwarding either
    way while it holds every socket open."""

    @classmethod
    async def start(cls, upstream, trickle=None):
        p = cls()
        p.upstream = upstream.rsplit(":", 1)
        p.trickle = trickle
        p.frozen = False
        p.conns = []
        p.server = await asyncio.start_server(p.accept, "127.0.0.1", 0)
        port = p.server.sockets[0].getsockname()[1]
        p.addr = f"127.0.0.1:{port}"
        return p

    async def accept(self, dr, dw):
        ur, uw = await asyncio.open_connection(self.upstream[0], int(self.upstream[1]))
        self.conns += [dw, uw]
        await asyncio.gather(self.pipe(dr, uw, None), self.pipe(ur, dw, self.trickle))

    async def pipe(self, r, w, trickle):
        passed = 0
        try:
            while True:
                data = await r.read(1 if trickle and passed >= 512 else 65536)
                if not data:
                    break
                while self.frozen:
                    await asyncio.sleep(3600)
                w.write(data)
                await w.drain()
                passed += len(data)
                if trickle and passed > 512:
                    await asyncio.sleep(trickle)
        except (ConnectionError, asyncio.CancelledError):
            pass

    def close(self):
        self.server.close()
        for w in self.conns:
            w.close()


async def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="the verifier, HOST:PORT (plaintext)")
    p.add_argument("--key", default="", help="the attacker tenant's API key")
    p.add_argument("--fingerprint", required=True, help="the model's tokenizer fingerprint")
    p.add_argument("--prompt-ids", required=True, help="the prompt's token ids, comma-separated")
    p.add_argument(
        "--attack",
        required=True,
        choices=[
            "oversized-q",
            "bad-draft-flood",
            "idle-sessions",
            "silent-streams",
            "slow-reader",
            "frozen-peer",
        ],
    )
    p.add_argument("--seconds", type=float, required=True)
    a = p.parse_args()
    at = Attacker(a)
    task = asyncio.create_task(getattr(at, a.attack.replace("-", "_"))())
    await asyncio.sleep(a.seconds)
    at.stop.set()
    try:
        await asyncio.wait_for(task, 10)
    except (asyncio.TimeoutError, Exception):
        task.cancel()
    print(at.tally.json(), flush=True)
    # Leave without waiting for the connections' orderly close.
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())
