// Command pause is the sandbox ("infra") container of a Pod on the phalanx test nodes: it holds the Pod's
// namespaces open, does nothing else, and exits when asked. The equivalent of Kubernetes' pause (written in
// C there), in Go's standard library only, built static (CGO_ENABLED=0) so the image is FROM scratch.
//
// As PID 1 of a Pod that shares its process namespace, it also reaps the zombies that orphaned processes
// leave behind.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is set with -ldflags "-X main.version=..." by scripts/images.
var version = "dev"

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "-v", "--version", "-version":
			fmt.Println("phalanx-pause", version)
			return
		}
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "Warning: pause should be the first process")
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			reap()
			continue
		}
		fmt.Fprintf(os.Stderr, "Shutting down, got signal: %v\n", sig)
		os.Exit(0)
	}
}

// reap collects every child that has exited; SIGCHLD coalesces, so one signal may stand for several.
func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
