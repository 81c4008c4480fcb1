# mk/chart.mk -- the Helm chart (charts/phalanx) and its copies of crds/ and deploy/operator-rbac.yaml.
#
#   make chart-sync    copy the CRD and the operator's RBAC rules into the chart (scripts/sync-chart)
#   make chart-check   fail when the chart drifted from crds/ or deploy/ (for `make lint`)
#   make chart-lint    `helm lint --strict` with a helm built from source by scripts/helm-binary
#                      (first run: a few minutes; then cached under ~/.cache/phalanx/tools)

.PHONY: chart-sync chart-check chart-lint

chart-sync: setup
	$(BIN)/python scripts/sync-chart

chart-check: setup
	$(BIN)/python scripts/sync-chart --check

chart-lint: chart-check
	@helm=$$(scripts/helm-binary | tail -1); $$helm lint --strict charts/phalanx
