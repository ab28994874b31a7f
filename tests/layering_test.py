#!/usr/bin/env python3
"""The layering of docs/architecture.md, checked include by include.

Every #include of a project file (C++, CUDA) is classified by the folder of
the file that includes and by the header it names; an include that points
against the allowed arrows fails the test with the file, the line and the
rule. The arrows:

    service -> store -> kernels
    service, client -> transport -> proto
    client -> kernels (dequantization)
    everything -> base
    fuzz -> anything but the client's private code (as tests/ may)
    python (the package's native module) -> the public client headers

and, in words: kernels/ and store/ know neither gRPC nor UCX; transport/
knows UCX but not gRPC; the node's data plane (service/ucx/) does not use
the rest of service/; the public client headers (client/include/kvcache/)
include only each other and the public codec vocabulary (kvcache/codec.h),
so that they can be installed as they are.

The CMake include roots (cmake/KvcacheIncludeRoot.cmake) enforce the same
arrows between libraries at compile time; this test also covers the arrows
inside one link (the data plane and the rest of service/, public and private
client headers) and third-party headers.

Usage: layering_test.py ROOT      check the tree under ROOT
       layering_test.py --self-test
"""

import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SOURCE_SUFFIXES = ('.h', '.cc', '.cu', '.cuh')

# Third-party families that only some layers may use.
GRPC = ('grpcpp/', 'grpc/', 'google/protobuf/')
UCX = ('ucp/', 'uct/', 'ucs/')
PROMETHEUS = ('prometheus/',)
CUDA = ('cuda', 'cub/', 'thrust/')


def component_of_file(path):
    """The layer a source file belongs to, by its path under the root."""
    if path.startswith('kernels/include/kvcache/'):
        return 'codec_api'
    if path.startswith('client/include/kvcache/'):
        return 'client_api'
    if path.startswith('client/examples/'):
        return 'examples'
    if path.startswith('service/ucx/'):
        return 'data_plane'
    top = path.split('/', 1)[0]
    if top in ('base', 'proto', 'kernels', 'transport', 'store', 'service',
               'client', 'tools', 'bench', 'tests', 'fuzz', 'python'):
        return top
    return None


def component_of_include(header):
    """The layer a quoted include names; None for a third-party header."""
    if header == 'kvcache/codec.h':
        return 'codec_api'
    if header.startswith(('kvcache/v1/', 'grpc/health/')):
        return 'proto'  # generated from proto/
    if header.startswith('kvcache/'):
        return 'client_api'
    if header.startswith('service/ucx/'):
        return 'data_plane'
    top = header.split('/', 1)[0]
    if top in ('base', 'proto', 'kernels', 'transport', 'store', 'service',
               'client', 'tools', 'tests', 'fuzz'):
        return top
    return None


# Project layers each layer may include (its own is always allowed).
ALLOWED = {
    'base': set(),
    'codec_api': set(),
    'kernels': {'base', 'codec_api'},
    'proto': {'base', 'codec_api'},
    'transport': {'base', 'proto'},
    'store': {'base', 'kernels', 'codec_api'},
    'data_plane': {'base', 'transport', 'proto', 'store', 'kernels',
                   'codec_api'},
    'service': {'base', 'data_plane', 'transport', 'proto', 'store',
                'kernels', 'codec_api'},
    'client_api': {'codec_api'},
    'client': {'client_api', 'base', 'transport', 'proto', 'kernels',
               'codec_api'},
    'examples': {'client_api', 'codec_api', 'kernels', 'base'},
    # The Python module links the client's public libraries only, as an
    # installed client would.
    'python': {'client_api', 'codec_api'},
    'tools': {'client_api', 'codec_api', 'kernels', 'base'},
    'bench': None,  # any layer: benchmarks drive each in process
    'tests': None,  # any layer
    # fuzz targets drive each decoder in process, like tests, but not the
    # client's private code (its public headers are fine).
    'fuzz': {'base', 'codec_api', 'kernels', 'proto', 'transport', 'store',
             'data_plane', 'service', 'client_api', 'tools', 'tests'},
}

# Third-party families each layer must not include.
FORBIDDEN_EXTERNAL = {
    'base': GRPC + UCX + PROMETHEUS + CUDA,
    'codec_api': GRPC + UCX + PROMETHEUS + CUDA,
    'kernels': GRPC + UCX + PROMETHEUS,
    'proto': UCX + PROMETHEUS + CUDA,
    'transport': GRPC + PROMETHEUS,
    'store': GRPC + UCX + PROMETHEUS,
    'data_plane': GRPC + PROMETHEUS,
    'client_api': GRPC + UCX + PROMETHEUS + CUDA,
    'python': GRPC + UCX + PROMETHEUS + CUDA,
}


def check_include(src_path, header, quoted):
    """None when `src_path` may include `header`, else the broken rule."""
    src = component_of_file(src_path)
    if src is None:
        return None
    if quoted:
        dst = component_of_include(header)
        if dst is not None:
            allowed = ALLOWED[src]
            if allowed is None or dst == src or dst in allowed:
                return None
            return f'{src} may not include {dst} (allowed: ' + (
                ', '.join(sorted(allowed)) or 'nothing of the project') + ')'
    for prefix in FORBIDDEN_EXTERNAL.get(src, ()):
        if header.startswith(prefix):
            return f'{src} may not include third-party {prefix}*'
    return None


def violations(root):
    """(the broken includes, how many files were checked)."""
    found = []
    checked = 0
    for folder, dirs, files in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        top = rel_folder.split(os.sep, 1)[0]
        if rel_folder != '.' and (top.startswith(('build', '.')) or
                                  top == 'shared' or
                                  rel_folder.startswith(
                                      os.path.join('python', 'build'))):
            dirs[:] = []
            continue
        for name in sorted(files):
            if not name.endswith(SOURCE_SUFFIXES):
                continue
            rel = os.path.normpath(os.path.join(rel_folder, name))
            rel = rel.replace(os.sep, '/')
            checked += 1
            with open(os.path.join(folder, name), encoding='utf-8') as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    why = check_include(rel, m.group(2), m.group(1) == '"')
                    if why:
                        found.append(f'{rel}:{number}: {line.strip()}: {why}')
    return found, checked


def self_test():
    """The rules reject what they must and accept the tree's usual arrows."""
    cases = [
        ('store/store.cc', 'kernels/codec.h', True, True),
        ('store/store.cc', 'service/node.h', True, False),
        ('store/store.cc', 'grpcpp/grpcpp.h', False, False),
        ('kernels/codec.cc', 'store/store.h', True, False),
        ('kernels/codec.cc', 'ucp/api/ucp.h', False, False),
        ('transport/wire.cc', 'grpcpp/grpcpp.h', True, False),
        ('transport/wire.cc', 'store/store.h', True, False),
        ('service/ucx/data_plane.cc', 'service/log.h', True, False),
        ('service/ucx/data_plane.cc', 'transport/wire.h', True, True),
        ('service/node.cc', 'service/ucx/data_plane.h', True, True),
        ('client/client.cc', 'service/node.h', True, False),
        ('client/client.cc', 'store/store.h', True, False),
        ('client/client.cc', 'transport/worker_loop.h', True, True),
        ('client/include/kvcache/client.h', 'kernels/codec.h', True, False),
        ('client/include/kvcache/client.h', 'kvcache/codec.h', True, True),
        ('client/include/kvcache/client.h', 'client/executor.h', True, False),
        ('proto/convert.h', 'kernels/codec.h', True, False),
        ('tools/soak.cc', 'service/node.h', True, False),
        ('tests/ucx_test.cc', 'service/ucx/data_plane.h', True, True),
        ('fuzz/fuzz_rpc.cc', 'service/kvcache_service.h', True, True),
        ('fuzz/fuzz_wire.cc', 'transport/wire.h', True, True),
        ('fuzz/fuzz_npy.cc', 'tools/npy.h', True, True),
        ('fuzz/fuzz_rpc.cc', 'kvcache/client.h', True, True),
        ('fuzz/fuzz_rpc.cc', 'client/ucx/client_plane.h', True, False),
        ('fuzz/fuzz_wire.cc', 'fuzz/fuzz_input.h', True, True),
        ('python/src/client_bind.cc', 'kvcache/client.h', True, True),
        ('python/src/client_bind.cc', 'client/client_impl.h', True, False),
        ('python/src/client_bind.cc', 'kernels/codec.h', True, False),
        ('python/src/module.cc', 'grpcpp/grpcpp.h', False, False),
    ]
    failed = 0
    for src, header, quoted, ok in cases:
        got = check_include(src, header, quoted) is None
        if got != ok:
            failed += 1
            print(f'self-test: {src} -> {header}: allowed={got}, want {ok}')
    return failed


def main(argv):
    if argv[1:] == ['--self-test']:
        return 1 if self_test() else 0
    if len(argv) != 2:
        print(__doc__)
        return 2
    if self_test():
        return 1
    found, checked = violations(argv[1])
    if checked == 0:
        print(f'no source files under {argv[1]}')
        return 1
    for line in found:
        print(line)
    if found:
        print(f'{len(found)} include(s) against the layering '
              '(docs/architecture.md, tests/layering_test.py)')
        return 1
    print(f'layering: the includes of {checked} files follow the arrows')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
