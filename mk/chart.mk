# mk/chart.mk -- the Helm chart (charts/phalanx) and its copies of crds/ and deploy/operator-rbac.yaml.
#
#   make chart-sync    copy the CRD and the operator's RBAC rules into the chart (scripts/sync-chart)
#   make chart-check   fail when the chart drifted from crds/ or deploy/ (for `make lint`)
#   make chart-lint    `helm lint --strict` with a helm built from source by scripts/go-tools
#                      (first run: tens of minutes with the other Go tools; then cached)

.PHONY: chart-sync chart-check chart-lint

chart-sync: setup
	$(BIN)/python scripts/sync-chart

chart-check: setup
	$(BIN)/python scripts/sync-chart --check

chart-lint: chart-check
	@helm=$$(scripts/go-tools helm); $$helm lint --strict charts/phalanx
