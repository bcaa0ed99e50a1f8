"""Prints a TCP port P on 127.0.0.1 such that P and P + 1 are both free right now.

Under torchrun the agent serves its store on MASTER_PORT and Tandem's rank 0 hosts its own on
MASTER_PORT + 1 (src/tandem/dist/init.cc), so a test that launches through torchrun needs both;
a port from bind(0) alone leaves P + 1 to chance (another test's socket may hold it).
"""
import socket

for _ in range(100):
    first = socket.socket()
    first.bind(("127.0.0.1", 0))
    port = first.getsockname()[1]
    second = socket.socket()
    try:
        if port < 65535:
            second.bind(("127.0.0.1", port + 1))
            print(port)
            break
    except OSError:
        pass
    finally:
        second.close()
        first.close()
else:
    raise SystemExit("free_port_pair.py: found no two adjacent free ports in 100 tries")
