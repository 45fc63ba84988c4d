"""The policy simulators moved to `cachedemb.sizing.simulators` (issue 24: the sizing tool and the collection's
`cache_rows="auto"` use them, and the library may not import `cachedemb.tools`). This name stays for the scripts
and tests written against it."""
from cachedemb.sizing.simulators import *  # noqa: F401,F403
from cachedemb.sizing.simulators import __all__  # noqa: F401
