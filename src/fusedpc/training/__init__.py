"""The training app behind `fusedpc train`: its config, the run loop, the log, data,
progress, plots, calibration from logs, and process-level runtime settings."""

from fusedpc.training import data as data
from fusedpc.training._calibrate import PartCalibration as PartCalibration
from fusedpc.training._calibrate import calibrate as calibrate
from fusedpc.training._calibrate import format_table as format_table
from fusedpc.training._config import TrainConfig as TrainConfig
from fusedpc.training._config_file import resolve_config as resolve_config
from fusedpc.training._config_file import resume_config as resume_config
from fusedpc.training._host_memory import HOST_MEMORY_MODES as HOST_MEMORY_MODES
from fusedpc.training._host_memory import REUSE_ABOVE_BYTES as REUSE_ABOVE_BYTES
from fusedpc.training._host_memory import gpt_step_temporaries as gpt_step_temporaries
from fusedpc.training._host_memory import host_memory_choice as host_memory_choice
from fusedpc.training._host_memory import host_memory_env as host_memory_env
from fusedpc.training._host_memory import host_memory_reused as host_memory_reused
from fusedpc.training._host_memory import reuse_host_memory as reuse_host_memory
from fusedpc.training._host_memory import wants_host_memory_reuse as wants_host_memory_reuse
from fusedpc.training._log import read_log as read_log
from fusedpc.training._loop import TrainResult as TrainResult
from fusedpc.training._loop import train as train
from fusedpc.training._optimisers import OPTIMISERS as OPTIMISERS
from fusedpc.training._optimisers import make_optimiser as make_optimiser
from fusedpc.training._runtime import emulate_cpu_devices as emulate_cpu_devices
from fusedpc.training._setup import load_run as load_run
from fusedpc.training._table import Column as Column
from fusedpc.training._table import format_rows as format_rows
from fusedpc.training.data import Tokenizer as Tokenizer
