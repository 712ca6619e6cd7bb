// Command kstatus prints what cli-utils' kstatus (the library Flux's health
// checks use) computes for each Kubernetes object read from standard input
// as JSON, one per line: its status, then a tab, then the message.
package main

import (
	"bufio"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 0, 1<<20), 16<<20)
	for in.Scan() {
		// Its own decoder: integers stay int64, as kstatus reads them.
		obj := &unstructured.Unstructured{}
		if err := obj.UnmarshalJSON(in.Bytes()); err != nil {
			fmt.Fprintln(os.Stderr, "not a Kubernetes object:", err)
			os.Exit(2)
		}
		result, err := status.Compute(obj)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kstatus:", err)
			os.Exit(1)
		}
		fmt.Printf("%s\t%s\n", result.Status, result.Message)
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}
