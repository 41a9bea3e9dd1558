import sys
import hydraspec.serve.learn as L
L.DiskWriter.put = lambda self, kind, job: None
from hydraspec.cli import main
sys.exit(main(sys.argv[1:]))
