# Two entry points for a new machine:  `make run` (main job)  and  `make test`.
# torch is installed first and pinned, so that no CUDA build is pulled in on CPU machines.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
OUT    ?= out

.PHONY: install run test test-fast profiles results clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[runtime,test]'
	touch $@

# Main job: plan a tiny GPT for an emulated 2-fast + 2-slow CPU cluster (fp32, ZeRO 1) on every
# device (--use-all: at this batch the fleet choice would leave the slow ranks out), then
# train it with 4 CPU processes (gloo) following that plan, on the shipped English corpus.
run: install
	$(BIN)/python tools/search_hpp.py --model tiny --cluster examples/clusters/cpu-demo.yaml --use-all \
	    --profiles profiles/measured/cpu.json --precision fp32 --gbs 16 --zero-stage 1 -o $(OUT)/plan.json
	OMP_NUM_THREADS=1 $(BIN)/hpp-run --standalone --nproc-per-node 4 pretrain_gpt.py \
	    --hpp-plan $(OUT)/plan.json --train-iters 20 --log-interval 1 \
	    --data-path megatron/hpp/corpus/english

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

# The same without the tests marked slow (multi-process launches, the exhaustive suites).
test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" tests

profiles: install
	$(BIN)/python tools/make_profiles.py -o profiles

# Rebuild what the repository ships from the planner (deterministic; writes over tracked files):
# the example plan (the main job's search), the analytic profiles, and the paper evaluation's
# tables, plans and plots in bench/results/ (the full run takes about 40 minutes on 2 cores).
# Measured results have their own commands: docs/EVALUATION.md.
results: profiles
	$(BIN)/python tools/search_hpp.py --model tiny --cluster examples/clusters/cpu-demo.yaml --use-all \
	    --profiles profiles/measured/cpu.json --precision fp32 --gbs 16 --zero-stage 1 -o examples/plans/cpu-demo.json
	$(BIN)/python tools/search_hpp.py --model gpt3-13b --cluster examples/clusters/b2b4-64.yaml --profiles profiles \
	    --gbs 1024 --seq 2048 --time-limit 60 -o bench/results/plans/gpt3-13b-b2b4-64-hpp-bf16.json
	$(BIN)/python tools/search_hpp.py --model gpt3-175b --cluster examples/clusters/b2b4-1024.yaml --profiles profiles \
	    --gbs 1536 --seq 2048 --time-limit 60 -o bench/results/plans/gpt3-175b-b2b4-1024-hpp-bf16.json
	$(BIN)/python bench/paper_eval.py --quick --update-results
	$(BIN)/python bench/paper_eval.py --update-results

clean:
	rm -rf $(VENV) $(OUT) *.egg-info
