"""Starting and watching a job's processes: N ranks of any command (ranks), islands' own workers forked from a
preloaded server (spawn), the elastic job's launcher and its detached job host (elastic, job_host), and ending a
running elastic job at a step (stop). Above the world and the elastic control plane: it starts them, they never
import it."""
