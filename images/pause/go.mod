module phalanx.dev/images/pause

go 1.22
