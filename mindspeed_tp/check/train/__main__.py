from ..main import exit_worker
from .main import main

exit_worker(main())
