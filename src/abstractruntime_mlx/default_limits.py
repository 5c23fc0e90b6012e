"""Default limits that the command line shows in its help.

They live apart from the code that enforces them (``runtime_plugin`` imports the host,
``server`` imports Starlette) so that building the parser imports neither.
"""

from __future__ import annotations

from typing import Final

# A driven run tree (runtime_plugin.DriveLimits, code_sandbox.CodeLimits).
DEFAULT_MAX_TIMER_WAIT_S: Final = 60.0
DEFAULT_MAX_STEPS: Final = 10_000
DEFAULT_MAX_DEPTH: Final = 16
DEFAULT_MAX_WALL_S: Final = 3600.0
DEFAULT_CODE_TIME_S: Final = 30.0
DEFAULT_CODE_MEMORY_MIB: Final = 1024
DEFAULT_CODE_RESULT_MIB: Final = 64  # the JSON of one code node call's result

# The run inspector's live event streams open at once (server.inspector_live).
DEFAULT_MAX_STREAMS: Final = 32

# serve's connection limits (server.connections).
DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_HEADER_TIMEOUT_S: Final = 10.0
DEFAULT_IDLE_TIMEOUT_S: Final = 5  # uvicorn's own default timeout_keep_alive; whole seconds
