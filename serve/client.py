"""Stream a completion from a running server to the terminal: `python -m serve.client "PROMPT"`."""

from __future__ import annotations

import argparse
import sys

import grpc

from serve import protos

pb2, pb2_grpc = protos.load()


def build_request(args: argparse.Namespace):
    request = pb2.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, stop=args.stop, ignore_eos=args.ignore_eos,
                                  chat=not args.no_chat)
    if args.top_k is not None:
        request.top_k = args.top_k
    if args.top_p is not None:
        request.top_p = args.top_p
    if args.seed is not None:
        request.seed = args.seed
    return request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.client", description="stream from a dspark server")
    parser.add_argument("prompt")
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as raw text")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        stub = pb2_grpc.DSparkStub(channel)
        last = None
        try:
            for response in stub.GenerateStream(build_request(args), timeout=args.timeout):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
        except grpc.RpcError as err:
            print(f"\nserve.client: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if last is not None:
        usage, spec = last.usage, last.speculative
        print(f"\n--- {pb2.FinishReason.Name(last.finish_reason)}: {usage.prompt_tokens} prompt + "
              f"{usage.completion_tokens} new tokens; {usage.accepted_tokens}/{usage.drafted_tokens} drafts accepted, "
              f"{spec.mean_accepted_length:.2f} tokens per round", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
